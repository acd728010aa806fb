"""`tessel generate`: complete prompts with a local model and print the completions.

torch is imported inside the command, so the planner side of the CLI loads without it. Sampling
options go through `SamplingParams` (the validation the HTTP API uses) before the model loads.
"""

from __future__ import annotations

from pathlib import Path

import typer

from tessel.commands.options import (
    ASYNC_SCHEDULING_OPTION,
    DEVICE_OPTION,
    ENFORCE_EAGER_OPTION,
    HOST_KV_OPTIONS,
    IGNORE_EOS_OPTION,
    LM_HEAD_OPTION,
    MAX_MODEL_LEN_OPTION,
    MAX_TOKENS_OPTION,
    SEED_OPTION,
    TEMPERATURE_OPTION,
    TENSOR_PARALLEL_OPTION,
    TOP_K_OPTION,
    TOP_P_OPTION,
    LMHeadMode,
    check_model_path,
    runtime_dtype_option,
    with_option_groups,
)


@with_option_groups
def generate(
    model: Path = typer.Option(..., "--model", help="Local Hugging Face model directory, or a .gguf file."),
    prompt: list[str] = typer.Option(..., "--prompt", help="A prompt; repeat for a batch."),
    max_tokens: int = MAX_TOKENS_OPTION,
    temperature: float = TEMPERATURE_OPTION,
    top_p: float = TOP_P_OPTION,
    top_k: int = TOP_K_OPTION,
    seed: int | None = SEED_OPTION,
    stop: list[str] = typer.Option([], "--stop", help="Stop string; repeatable."),
    dtype: str = runtime_dtype_option(),
    max_model_len: int | None = MAX_MODEL_LEN_OPTION,
    ignore_eos: bool = IGNORE_EOS_OPTION,
    lm_head: LMHeadMode = LM_HEAD_OPTION,
    enforce_eager: bool = ENFORCE_EAGER_OPTION,
    async_scheduling: bool = ASYNC_SCHEDULING_OPTION,
    tensor_parallel_size: int = TENSOR_PARALLEL_OPTION,
    device: str = DEVICE_OPTION,
    host_kv: dict[str, object] = HOST_KV_OPTIONS,
) -> None:
    """Generate completions for one or more --prompt with the model in --model."""
    checked = check_model_path(model, "--model")  # the one model reader, before anything loads
    from rich.console import Console

    from tessel.engine.llm_engine import LLM
    from tessel.engine.sampling_params import SamplingParams
    from tessel.text import check_text

    params = SamplingParams(
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        max_tokens=max_tokens,
        seed=seed,
        stop=list(stop),
        ignore_eos=ignore_eos,
    )  # the same validation as the HTTP API: a bad value stops here, before the model loads
    params.verify(checked.config.vocab_size)
    for index, text in enumerate(prompt):
        check_text(text, f"--prompt {index + 1}")  # what the engine's tokenize checks, before it loads
    kwargs = host_kv if max_model_len is None else host_kv | {"max_model_len": max_model_len}
    llm = LLM(
        str(model),
        dtype=dtype,
        lm_head=lm_head,
        enforce_eager=enforce_eager,
        async_scheduling=async_scheduling,
        device=device,
        tensor_parallel_size=tensor_parallel_size,
        **kwargs,
    )
    outputs = llm.generate(list(prompt), params, use_progress=len(prompt) > 1)
    console = Console(highlight=False)
    for output in outputs:
        if len(outputs) > 1:
            console.print(f"[bold]>>> {output.prompt}[/bold]", markup=True)
        console.print(output.text, markup=False)
        console.print(
            f"[dim]({output.num_output_tokens} tokens, finish_reason={output.finish_reason})[/dim]",
            markup=True,
        )
        if output.error is not None:  # this prompt failed in the engine; the others are unaffected
            console.print(f"error: {type(output.error).__name__}: {output.error}", markup=False)
