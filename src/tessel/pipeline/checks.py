"""Everything checkable before a stage process starts: the plan against the model, the world and this
machine's devices (`check_run`), and a run's requests against the model.

Stage 0's engine checks a request when it is added, which is after every stage has loaded: a bad
one would end the run with exit 1 once the stages are up. `check_prompt_chars` and
`check_requests` make the same checks first, in the launching process, so `tessel launch` refuses
with exit 2 before spawning anything:

- a text prompt longer than `max_prompt_chars` (the server's `--max-prompt-chars`), by its
  characters before it is tokenized: a 10 MB line is refused at once, not tokenized whole;
- token ids outside the vocabulary, `top_k` above it (`SamplingParams.verify`, the engine's rule);
- a prompt plus `max_tokens` longer than `max_model_len` (the engine's `max_model_len`).

Each message names the request ("FILE:LINE" of a prompts-file line, "--prompt N").
"""

from __future__ import annotations

from pathlib import Path

from tessel.engine.engine_config import EngineConfig
from tessel.engine.limits import MAX_TORCH_THREADS, check_emulate_host_gbps, check_kv_cache_gib
from tessel.engine.llm_engine import load_tokenizer, max_model_len
from tessel.engine.sampling_params import SamplingParams
from tessel.engine.weight_stream import check_offload
from tessel.errors import TesselError
from tessel.models.config import ModelConfig, resolve_dtype
from tessel.models.reader import read_model
from tessel.pipeline.devices import check_devices, cuda_devices, link_transports
from tessel.pipeline.flow import PathFeatures
from tessel.pipeline.options import RunOptions
from tessel.pipeline.prompts_file import RunRequest, read_requests
from tessel.pipeline.run_plan import RunPlan, load_run_plan
from tessel.pipeline.supervision.heartbeat import heartbeat_timeout_s
from tessel.plan.files.workload import MAX_MICRO_BATCHES
from tessel.text import check_text


def check_run(
    options: RunOptions,
    world_size: int | None = None,
    rank: int | None = None,
    local_ranks: list[int] | None = None,
) -> tuple[RunPlan, ModelConfig]:
    """The plan against the model, the world and this machine's devices (every stage's; under
    torchrun, `rank`'s own); -> the plan and the model's config."""
    if not options.model.is_dir():
        raise TesselError(
            f"--model {options.model} is not a directory; give a local Hugging Face model directory"
        )
    plan = load_run_plan(options.plan, options.replica)
    config = read_model(options.model).config  # the one model reader: config and weights agree
    plan.check_model(options.model.resolve().name, config.num_hidden_layers)
    if world_size is not None and world_size != len(plan.stages):
        raise TesselError(f"WORLD_SIZE is {world_size} but the plan has {len(plan.stages)} stages")
    limits = (("micro_batches", MAX_MICRO_BATCHES), ("threads", MAX_TORCH_THREADS), ("cpp_min_tokens", None))
    for name, most in limits:
        value = getattr(options, name)
        if value is not None and not (1 <= value and (most is None or value <= most)):
            bound = f"in [1, {most}]" if most is not None else ">= 1"
            raise TesselError(f"--{name.replace('_', '-')} must be {bound}, got {value}")
    if not PathFeatures.of(plan).nccl and options.transport == "nccl":
        raise TesselError("--transport nccl: a flow plan's placements pass micro-batches over gloo (host)")
    link_transports(plan, options.transport)
    local = [rank] if rank is not None else local_ranks
    check_devices(plan, cuda_devices(), local)
    check_tensor_parallel_stages(plan, config, options.model, options.cpp)
    dtype = resolve_dtype(options.dtype, config)
    check_offload(plan.stages, config, dtype, local)
    return plan, config


def run_requests(options: RunOptions) -> list[RunRequest]:
    """The requests of a run (`--prompt`s, then the prompts file's), each checked for length."""
    defaults = SamplingParams(
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        max_tokens=options.max_tokens,
        seed=options.seed,
        ignore_eos=options.ignore_eos,
    )
    requests = [RunRequest(p, defaults, f"--prompt {i + 1}") for i, p in enumerate(options.prompts)]
    if options.prompts_file is not None:
        requests += read_requests(options.prompts_file, defaults)
    if not requests:
        raise TesselError("give at least one --prompt or a --prompts-file")
    check_prompt_chars(requests, options.max_prompt_chars)
    return requests


def check_prompt_chars(requests: list[RunRequest], max_prompt_chars: int) -> None:
    """Refuse a text prompt over `max_prompt_chars` characters (before anything tokenizes it)."""
    for request in requests:
        if isinstance(request.prompt, str) and len(request.prompt) > max_prompt_chars:
            raise TesselError(
                f"{request.where}: the prompt has {len(request.prompt)} characters; at most "
                f"{max_prompt_chars} are accepted (--max-prompt-chars)"
            )


def check_options(options: RunOptions, local_ranks: list[int] | None = None) -> int:
    """Refuse what would fail in the stage processes (plan vs model, the requests against the
    tokenizer and max_model_len) before any starts; -> the number of stages. `local_ranks`: the
    stages on this machine, whose devices are checked here (None: all)."""
    heartbeat_timeout_s(options.heartbeat_timeout)
    for name in ("kv_cache_gib", "host_kv_cache_gib"):
        check_kv_cache_gib(getattr(options, name), name)
    check_emulate_host_gbps(options.emulate_host_gbps, "emulate_host_gbps")
    plan, config = check_run(options, local_ranks=local_ranks)
    check_requests(run_requests(options), options.model, config, options.engine_kwargs())
    return len(plan.stages)


def check_requests(
    requests: list[RunRequest], model: Path, model_config: ModelConfig, engine_options: dict
) -> None:
    """Refuse what stage 0's engine would refuse when adding the requests (see the module)."""
    context = max_model_len(EngineConfig(**engine_options), model_config)
    vocab = model_config.vocab_size
    for request in requests:
        try:
            request.params.verify(vocab)
        except TesselError as error:
            raise TesselError(f"{request.where}: {error}") from None
    lengths = _prompt_lengths(requests, model, vocab)
    for request, length in zip(requests, lengths, strict=True):
        max_tokens = request.params.max_tokens
        total = length + (max_tokens if max_tokens is not None else 1)
        if total > context:
            raise TesselError(
                f"{request.where}: the prompt has {length} tokens and max_tokens is {max_tokens}: {total} > "
                f"max_model_len={context}; shorten the prompt, lower max_tokens or raise --max-model-len"
            )


def _prompt_lengths(requests: list[RunRequest], model: Path, vocab: int) -> list[int]:
    """Tokens per prompt: text prompts tokenized in one batch, token-id prompts checked."""
    texts = {}
    for index, request in enumerate(requests):
        if isinstance(request.prompt, str):
            try:
                texts[index] = check_text(request.prompt, "the prompt")
            except TesselError as error:
                raise TesselError(f"{request.where}: {error}") from None
        else:
            bad = [t for t in request.prompt if not 0 <= t < vocab]
            if bad:
                shown = [t if abs(t) < 10**12 else "..." for t in bad[:5]]
                raise TesselError(
                    f"{request.where}: prompt token ids {shown} are outside the vocabulary [0, {vocab})"
                )
    encoded = {}
    if texts:
        ids = load_tokenizer(model)(list(texts.values()))["input_ids"]
        encoded = dict(zip(texts, ids, strict=True))
    lengths = []
    for index, request in enumerate(requests):
        length = len(encoded[index]) if index in encoded else len(request.prompt)
        if length == 0:
            raise TesselError(f"{request.where}: the prompt is empty; give at least one token")
        lengths.append(length)
    return lengths


def check_tensor_parallel_stages(
    plan: RunPlan, config: ModelConfig, model: Path | None = None, cpp: bool = False
) -> None:
    """Refuse, before any process starts, the tensor-parallel stages this run cannot run, naming the
    stage and the numbers. First the planner's checks of the plan file (`check_tp_stages`, against the
    checkpoint in `model` and the cluster the plan names): a degree other than 1, 2, 4, 8 or one that
    does not divide the model's heads and KV heads, `gpus` that do not list one GPU per rank from the
    stage's device, a GPU named twice. Then what only the runtime knows: a split the model refuses
    (mixture-of-experts), more GPUs than this machine has, ranks naming a CUDA index twice (within the
    stage or across stages), layers streamed from host memory, and, when `cpp` cuts prompts, a stage
    without the `tp_link` its all-reduces are priced on. The engine's `--tensor-parallel-size` runs
    only the runtime's checks, which allow uneven KV-head runs (3 KV heads over 2 ranks: 2 and 1)."""
    from tessel.parallel.executor import check_tensor_parallel

    if not any(stage.tp_degree > 1 for stage in plan.stages):
        return
    if model is not None:
        from tessel.catalog.models import load_model
        from tessel.plan.files.tp_checks import check_tp_stages

        check_tp_stages(plan.plan_file, load_model(model))
    taken: dict[int, int] = {}
    for stage in plan.stages:
        if stage.tp_degree == 1:
            continue
        gpus = list(stage.tp_gpus) if stage.tp_gpus is not None else None
        device = "cuda" if stage.is_cuda else "cpu"
        check_tensor_parallel(config, stage.tp_degree, device, gpus, f"stage {stage.index}")
        if stage.offload_layers:
            raise TesselError(
                f"stage {stage.index}: layers streamed from host memory (offload_layers "
                f"{list(stage.offload_layers)}) cannot run tensor-parallel yet; give the stage tp_degree 1"
            )
        for gpu in gpus or []:
            if gpu in taken:
                raise TesselError(
                    f"stage {stage.index}: GPU {gpu} is already a tensor-parallel rank of stage {taken[gpu]}"
                )
            taken[gpu] = stage.index
    if cpp and len(plan.stages) > 1 and PathFeatures.of(plan).cpp:
        _check_tp_links(plan)


def _check_tp_links(plan: RunPlan) -> None:
    """The CPP chunk planner prices every stage of the plan, a tensor-parallel one with its ring."""
    file = plan.plan_file
    stages = file.replicas[plan.replica].stages if plan.replica is not None and file.replicas else file.stages
    for position, stage in enumerate(stages):
        if stage.tp_degree > 1 and stage.tp_link_spec is None:
            raise TesselError(
                f"{plan.path}: stage {position} ({stage.device}): tp_degree {stage.tp_degree} without "
                "`tp_link` (bandwidth_gbps, latency_us of its ranks' ring), so the CPP chunk planner "
                "cannot price its all-reduces; give the stage its tp_link (`tessel plan` writes it) or "
                "run with --no-cpp"
            )
