"""`tessel launch`: run a plan as one process per stage on this machine and print the completions.

torch is imported only by the workers and inside the command, so the planner side of the CLI
loads without it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from tessel.commands.options import (
    EXECUTOR_OPTION,
    FORCE_PROFILE_OPTION,
    HOST_KV_OPTIONS,
    IGNORE_EOS_OPTION,
    MAX_MODEL_LEN_OPTION,
    MAX_NUM_SEQS_OPTION,
    MAX_TOKENS_OPTION,
    RAY_ADDRESS_OPTION,
    SEED_OPTION,
    TEMPERATURE_OPTION,
    TOP_K_OPTION,
    TOP_P_OPTION,
    ExecutorKind,
    heartbeat_timeout_option,
    input_file,
    kv_cache_gib_option,
    output_file,
    runtime_dtype_option,
    with_option_groups,
)
from tessel.engine.limits import MAX_TORCH_THREADS
from tessel.errors import TesselError
from tessel.plan.files.workload import MAX_MICRO_BATCHES
from tessel.server.limits import DEFAULT_MAX_PROMPT_CHARS

if TYPE_CHECKING:
    from tessel.sim.measured import RunIdentity


@with_option_groups
def launch(
    plan: Path = input_file(..., "--plan", help="Plan file from `tessel plan --json`."),
    model: Path = typer.Option(..., "--model", help="Local Hugging Face model directory."),
    prompt: list[str] = typer.Option([], "--prompt", help="A prompt; repeat for a batch."),
    prompts_file: Path | None = input_file(
        None, "--prompts-file", help="JSONL: one request per line (a string, or {prompt, sampling fields})."
    ),
    max_tokens: int = MAX_TOKENS_OPTION,
    temperature: float = TEMPERATURE_OPTION,
    top_p: float = TOP_P_OPTION,
    top_k: int = TOP_K_OPTION,
    seed: int | None = SEED_OPTION,
    ignore_eos: bool = IGNORE_EOS_OPTION,
    json_out: Path | None = output_file(
        None, "--json", help="Write per request token_ids and text, and the measured metrics (`measured`)."
    ),
    dtype: str = runtime_dtype_option(),
    max_num_seqs: int | None = MAX_NUM_SEQS_OPTION,
    max_model_len: int | None = MAX_MODEL_LEN_OPTION,
    kv_cache_gib: float | None = kv_cache_gib_option("KV pool size (all stages' share), GiB."),
    micro_batches: int | None = typer.Option(
        None, min=1, max=MAX_MICRO_BATCHES, help="Micro-batches in flight (default: the plan's m)."
    ),
    cpp: bool = typer.Option(True, help="Cut long prompts into the CPP planner's chunks."),
    cpp_min_tokens: int = typer.Option(512, min=1, help="Cut only prompts longer than this."),
    profile: list[Path] = typer.Option([], "--profile", help="`tessel profile` JSON to price CPP chunks."),
    force_profile: bool = FORCE_PROFILE_OPTION,
    threads: int = typer.Option(1, min=1, max=MAX_TORCH_THREADS, help="torch threads per stage process."),
    replica: int | None = typer.Option(
        None, min=0, help="Replica plans: which pipeline to run (route requests by the plan's weights)."
    ),
    run_dir: Path | None = typer.Option(
        None, "--run-dir", help="Where stages write their status and logs (default: a new temp folder)."
    ),
    executor: ExecutorKind = EXECUTOR_OPTION,
    ray_address: str | None = RAY_ADDRESS_OPTION,
    heartbeat_timeout: float | None = heartbeat_timeout_option(
        "Seconds a stage may send no heartbeat (stopped, hung) before the run fails"
    ),
    max_prompt_chars: int = typer.Option(
        DEFAULT_MAX_PROMPT_CHARS, min=1, help="Longest text prompt, refused before it is tokenized."
    ),
    transport: str = typer.Option(
        "auto",
        help="How hidden states cross links: auto (NCCL between two GPUs, else pinned host "
        "buffers over gloo), nccl or host.",
    ),
    host_kv: dict[str, object] = HOST_KV_OPTIONS,
) -> None:
    """Run PLAN on MODEL as one process per stage, each on its plan device, and print the outputs."""
    from tessel.commands.render.launch import print_run
    from tessel.files import check_output_path, claim_directory, write_text_file
    from tessel.pipeline.options import RunOptions
    from tessel.pipeline.run import describe_links, run_pipeline
    from tessel.sim.measured import RUN_FILE_VERSION, measured_metrics

    if not prompt and prompts_file is None:
        raise TesselError("give at least one --prompt or a --prompts-file")
    inputs = (plan, model, prompts_file, *profile)
    if json_out is not None:
        check_output_path(json_out, "--json", inputs)  # before the stages start
    if run_dir is not None:  # new, empty, or a run folder of tessel's: never a folder of the user's
        claim_directory(run_dir, "--run-dir", inputs=inputs)
    if profile:  # another device's, model's or tessel's profile: refused (or warned) before any stage starts
        from tessel.chunk.from_plan import plan_profiles
        from tessel.plan.files.plan_file import load_plan

        plan_profiles(load_plan(plan), profile, force_profile)
    options = RunOptions(
        plan, model, prompts=list(prompt), prompts_file=prompts_file, max_tokens=max_tokens,
        temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, ignore_eos=ignore_eos, dtype=dtype,
        max_num_seqs=max_num_seqs, max_model_len=max_model_len, kv_cache_gib=kv_cache_gib,
        micro_batches=micro_batches, cpp=cpp, cpp_min_tokens=cpp_min_tokens, profiles=list(profile),
        threads=threads, run_dir=run_dir, replica=replica, heartbeat_timeout=heartbeat_timeout,
        max_prompt_chars=max_prompt_chars, transport=transport, executor=executor, ray_address=ray_address,
        **host_kv,
    )  # fmt: skip
    if ray_address is not None and executor != "ray":
        raise TesselError("--ray-address joins a Ray cluster; give --executor ray too")
    for line in describe_links(options):
        typer.echo(line, err=True)
    run = run_pipeline(options)
    measured = measured_metrics(run.requests, run.wall_s)
    add_stage_utilization(run.stages, options)
    print_run(run, measured)
    if json_out is not None:
        document = {
            "version": RUN_FILE_VERSION,
            "run": run_identity(options).to_json(),  # what `tessel simulate --measured` checks
            "measured": measured.to_json(),
            "requests": run.requests,
            "stages": run.stages,
            "wall_s": run.wall_s,
        }
        write_text_file(json_out, json.dumps(document, indent=1), "--json", inputs)


def add_stage_utilization(stages: list[dict], options) -> None:  # noqa: ANN001 (RunOptions)
    """Each stage's measured MFU and MBU (`utilization`: {mfu, mbu}, fractions of its device type's
    catalog peak; {} where the catalog lacks the type) in its status dict."""
    from tessel.catalog import load_model
    from tessel.commands.render.launch import measured_stage_utilization
    from tessel.dtypes import ALIASES
    from tessel.models.config import ModelConfig, resolve_dtype
    from tessel.pipeline.run_plan import load_run_plan

    plan = load_run_plan(options.plan, options.replica)
    torch_dtype = resolve_dtype(options.dtype, ModelConfig.from_dir(options.model))
    dtype = ALIASES[str(torch_dtype).removeprefix("torch.")]
    gpu_types = [stage.gpu_type for stage in plan.stages]
    utilizations = measured_stage_utilization(stages, gpu_types, load_model(str(options.model)), dtype)
    for status, util in zip(stages, utilizations, strict=False):
        status["utilization"] = util


def run_identity(options) -> RunIdentity:  # noqa: ANN001 (tessel.pipeline.options.RunOptions)
    """The plan and scheduler settings a run used, with the runtime's defaults filled in."""
    from tessel.engine.engine_config import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS
    from tessel.pipeline.run_plan import load_run_plan
    from tessel.sim.measured import RunIdentity

    plan = load_run_plan(options.plan, options.replica)
    return RunIdentity(
        plan=str(options.plan),
        model_name=plan.plan_file.model_name,
        cluster_name=plan.plan_file.cluster_name,
        stage_layers=tuple((s.layer_start, s.layer_end) for s in plan.stages),
        replica=options.replica,
        micro_batches=options.micro_batches or plan.micro_batches,
        max_num_seqs=options.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
        max_num_batched_tokens=options.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
    )
