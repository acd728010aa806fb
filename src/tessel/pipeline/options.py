"""How a plan's pipeline runs, typed, from the command line to every stage process.

`RunOptions` is what `tessel launch`, `tessel serve --plan`, the benchmarks and the tests build; the
stage processes get it as a JSON file (`write`, then `read` in `tessel.pipeline.stage.worker`), never
as command-line arguments parsed again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

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
    async_scheduling: bool = False  # stage 0's decode micro-batches computed while the engine goes on

    executor: str = "local"  # where the other stages run: "local" (processes here) or "ray" (their nodes)
    ray_address: str | None = None  # with "ray": HOST:PORT of the cluster's head (None: this machine's)
    outputs: Path | None = None  # stage 0 writes each request's tokens, text and timings there
    quiet: bool = True  # stage 0 does not print the completions

    def engine_kwargs(self) -> dict:
        """The engine settings these options give (`tessel.engine.engine_config.EngineConfig`)."""
        options = {
            "dtype": self.dtype,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "kv_cache_gib": self.kv_cache_gib,
            "preemption_mode": self.preemption_mode,
            "host_kv_cache_gib": self.host_kv_cache_gib,
            "emulate_host_gbps": self.emulate_host_gbps,
            "max_num_batched_tokens": self.max_num_batched_tokens,
        }
        if self.async_scheduling:
            options["async_scheduling"] = True
        return {key: value for key, value in options.items() if value is not None}

    def write(self, path: Path) -> Path:
        """The options as JSON at `path` (what a stage process reads, `RunOptions.read`); -> `path`."""
        data = {f.name: getattr(self, f.name) for f in fields(self)}
        text = json.dumps(data, default=lambda value: str(value) if isinstance(value, Path) else value)
        path.write_text(text)
        return path

    @classmethod
    def read(cls, path: Path) -> RunOptions:
        data = json.loads(Path(path).read_text())
        for name in ("plan", "model", "prompts_file", "run_dir", "outputs"):
            if data.get(name) is not None:
                data[name] = Path(data[name])
        data["profiles"] = [Path(p) for p in data.get("profiles", [])]
        return cls(**data)
