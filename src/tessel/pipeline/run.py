"""Run a plan on this machine: check it, spawn one worker per stage, collect outputs and statuses.

`run_pipeline(RunOptions(...))` is what `tessel launch` and the benchmark call. The plan is
checked against the model in this process first, so a bad plan is refused before any worker
starts.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from tessel.engine.limits import check_emulate_host_gbps, check_kv_cache_gib
from tessel.errors import TesselError
from tessel.pipeline.heartbeat import heartbeat_timeout_s
from tessel.pipeline.launcher import launch
from tessel.server.limits import DEFAULT_MAX_PROMPT_CHARS


@dataclass(slots=True)
class RunOptions:
    plan: Path
    model: Path
    prompts: list[str] = field(default_factory=list)
    prompts_file: Path | None = None
    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    dtype: str = "float32"
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    kv_cache_gib: float | None = None
    preemption_mode: str = "auto"  # what preempted requests' KV blocks get (tessel.engine.preemption)
    host_kv_cache_gib: float | None = None
    emulate_host_gbps: float | None = None  # KV copies slowed to this host link, Gbit/s (emulation)
    max_num_batched_tokens: int | None = None
    micro_batches: int | None = None
    cpp: bool = True
    cpp_min_tokens: int = 512
    profiles: list[Path] = field(default_factory=list)
    threads: int = 1
    run_dir: Path | None = None
    warmup: bool = False  # one untimed request per prompt length first
    replica: int | None = None  # which pipeline of a replica plan
    heartbeat_timeout: float | None = None  # seconds a stage may be silent (None: the env's, or 30)
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS  # longer text prompts are refused untokenized
    transport: str = "auto"  # how the stream crosses links (tessel.pipeline.devices)

    def worker_argv(self, outputs: Path) -> list[str]:
        argv = ["--plan", str(self.plan), "--model", str(self.model), "--json", str(outputs), "--quiet"]
        for prompt in self.prompts:
            argv += ["--prompt", prompt]
        optional = {
            "--prompts-file": self.prompts_file,
            "--seed": self.seed,
            "--max-num-seqs": self.max_num_seqs,
            "--max-model-len": self.max_model_len,
            "--kv-cache-gib": self.kv_cache_gib,
            "--host-kv-cache-gib": self.host_kv_cache_gib,
            "--emulate-host-gbps": self.emulate_host_gbps,
            "--max-num-batched-tokens": self.max_num_batched_tokens,
            "--micro-batches": self.micro_batches,
            "--replica": self.replica,
            "--max-prompt-chars": self.max_prompt_chars,
        }
        for flag, value in optional.items():
            if value is not None:
                argv += [flag, str(value)]
        argv += ["--max-tokens", str(self.max_tokens), "--temperature", str(self.temperature)]
        argv += ["--top-p", str(self.top_p), "--top-k", str(self.top_k), "--dtype", self.dtype]
        argv += ["--cpp-min-tokens", str(self.cpp_min_tokens), "--threads", str(self.threads)]
        argv += ["--transport", self.transport, "--preemption-mode", self.preemption_mode]
        argv += ["--ignore-eos"] if self.ignore_eos else []
        argv += ["--warmup"] if self.warmup else []
        argv += [] if self.cpp else ["--no-cpp"]
        for profile in self.profiles:
            argv += ["--profile", str(profile)]
        return argv


@dataclass(slots=True)
class PipelineRun:
    requests: list[dict]  # per request: token_ids, text, finish_reason, ttft_s, tpot_s, ...
    stages: list[dict]  # per stage: layers, weight_bytes, rss_bytes, batches, compute_s, ...
    wall_s: float  # stage 0's generate, from the first request added to the last token
    run_dir: Path


def check_options(options: RunOptions) -> int:
    """Refuse what would fail in the workers (plan vs model, the requests against the tokenizer and
    max_model_len) before any starts; -> the number of stages."""
    from tessel.pipeline.request_checks import check_requests
    from tessel.pipeline.worker import engine_kwargs, parser, run_requests, validate

    heartbeat_timeout_s(options.heartbeat_timeout)
    for name in ("kv_cache_gib", "host_kv_cache_gib"):
        check_kv_cache_gib(getattr(options, name), name)
    check_emulate_host_gbps(options.emulate_host_gbps, "emulate_host_gbps")
    args = parser().parse_args(options.worker_argv(Path("unused.json")))
    plan, config = validate(args)
    check_requests(run_requests(args), args.model, config, engine_kwargs(args))
    return len(plan.stages)


def describe_links(options: RunOptions) -> list[str]:
    """Where each stage runs and how the stream crosses each link, one line each (printed at start)."""
    from tessel.pipeline.devices import describe_links as lines
    from tessel.pipeline.devices import link_transports, stage_device
    from tessel.pipeline.run_plan import load_run_plan

    plan = load_run_plan(options.plan, options.replica)
    if plan.paths:
        from tessel.pipeline.flow_routing import describe

        return describe(plan)
    if len(plan.stages) == 1:
        return [f"one stage on {stage_device(plan.stages[0])}"]
    return lines(plan, link_transports(plan, options.transport))


def run_pipeline(options: RunOptions) -> PipelineRun:
    num_stages = check_options(options)
    run_dir = options.run_dir or Path(tempfile.mkdtemp(prefix="tessel-run-"))
    outputs = run_dir / "outputs.json"
    result = launch(options.worker_argv(outputs), num_stages, run_dir, options.heartbeat_timeout)
    try:
        data = json.loads(outputs.read_text())
    except (OSError, ValueError) as error:
        raise TesselError(f"stage 0 finished but wrote no outputs ({error}); see {run_dir}") from None
    return PipelineRun(data["requests"], result.statuses, float(data["wall_s"]), run_dir)
