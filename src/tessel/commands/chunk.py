"""`tessel chunk`: cut a long prompt into pipeline chunks (CPP) for a plan, against the baselines."""

from __future__ import annotations

from pathlib import Path

import typer

from tessel.chunk.planner import MAX_PROMPT_TOKENS
from tessel.commands.options import FORCE_PROFILE_OPTION, input_file, output_file, plan_dtype_option


class SeqLens(tuple):
    """Prompt lengths in tokens, from `--seq-len N` or `N1,N2,...`."""


def parse_seq_lens(text: str | SeqLens) -> SeqLens:
    if isinstance(text, SeqLens):
        return text
    try:
        lengths = SeqLens(int(part) for part in str(text).replace(" ", "").split(",") if part)
    except ValueError:
        raise ValueError(f"want a token count or a comma-separated list, got {str(text)[:60]!r}") from None
    if not lengths or not all(1 <= n <= MAX_PROMPT_TOKENS for n in lengths):
        raise ValueError(f"token counts from 1 to {MAX_PROMPT_TOKENS}, got {str(text)[:60]!r}")
    return lengths


def chunk(
    seq_len: SeqLens = typer.Option(
        ..., "--seq-len", parser=parse_seq_lens, help="Prompt tokens, or a batch: N1,N2,..."
    ),
    plan: Path | None = input_file(None, "--plan", help="Plan JSON from `tessel plan --json`."),
    model: str | None = typer.Option(None, "--model", help="Without --plan: model preset or path."),
    cluster: str = typer.Option(
        "mixed-a100-v100-t4", "--cluster", help="Without --plan: cluster name or YAML."
    ),
    stages: int | None = typer.Option(
        None, "--stages", min=1, max=4096, help="Without --plan: use the first N devices."
    ),
    dtype: str = plan_dtype_option("fp16", "--dtype", help="Without --plan: weight dtype"),
    grid: int = typer.Option(
        64, "--grid", min=1, max=MAX_PROMPT_TOKENS, help="Chunk boundaries on multiples of this many tokens."
    ),
    max_chunk_tokens: int | None = typer.Option(
        None, "--max-chunk-tokens", min=1, max=MAX_PROMPT_TOKENS, help="Memory cap per chunk."
    ),
    profiles: list[Path] = input_file([], "--profile", help="Profile JSON(s) from `tessel profile`."),
    force_profile: bool = FORCE_PROFILE_OPTION,
    exact: bool | None = typer.Option(
        None, "--exact/--no-exact", help="Force (or skip) the exact search; default: small grids only."
    ),
    json_out: Path | None = output_file(None, "--json", help="Write chunks, TTFT and baselines as JSON."),
) -> None:
    """Plan CPP chunks for a prompt (or a batch) on a plan's pipeline; compare with the baselines."""
    from rich.console import Console

    from tessel.chunk.api import chunk_prompts
    from tessel.commands.render.chunk import print_chunks
    from tessel.files import check_output_path, write_json_file

    if json_out is not None:
        check_output_path(json_out, "--json", inputs=(plan, model, cluster, *profiles))
    outcome = chunk_prompts(
        seq_len,
        plan=plan,
        model=model,
        cluster=cluster,
        stages=stages,
        dtype=dtype,
        grid_tokens=grid,
        max_chunk_tokens=max_chunk_tokens,
        profiles=profiles,
        exact=exact,
        force_profile=force_profile,
    )
    console = Console()
    print_chunks(console, outcome)
    if json_out is not None:
        console.print(f"wrote {write_json_file(json_out, outcome.to_json(), '--json')}")
