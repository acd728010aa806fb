"""What every script in benchmarks/ shares: the timer, the machine, the git commit, the record file,
the real model.

Run a benchmark as `python benchmarks/NAME.py`: its folder is then on the import path and
`import _harness` works without touching `sys.path`.

- Timer: `time_calls` / `time_call` time callables with `warmup` untimed rounds then `repeats`
  timed rounds, several callables interleaved round by round (a load change on a shared machine
  hits them alike), and give every run's seconds with their median and minimum. Underneath is the
  layer profiler's own timer (`tessel.profiling.layer.time_runs`, `make_clock`): clock "wall",
  "cpu" (process CPU time), "cuda" (CUDA events after a synchronize) or "cuda-wall" (wall time
  between synchronizes, for end-to-end runs that include host work). `stopwatch()` takes the wall
  and CPU seconds of one block.
- Machine: `machine()` is the CPU (model, cores, ISA: AVX2 / AVX-512 / VNNI / AMX, PyTorch's CPU
  capability and tessel's int8 / W8A16 paths from `tessel.kernels.cpu_features`), the GPU when
  there is one, torch and Python; `machine_line()` says it in one line for the console.
- Records: one file per benchmark, `benchmarks/results/<benchmark>.jsonl`, JSON Lines: every run
  APPENDS one line, a JSON object

      {"benchmark": "quant", "label": "...", "time_utc": "2026-11-26T10:00:00+00:00",
       "git_sha": "<40 hex>", "git_dirty": false, "command": "python benchmarks/quant.py ...",
       "machine": {...}, "result": {...the script's own figures...}}

  `label` is the run's name (`--label`; empty by default). Records folded in from the result files
  of earlier sessions have `source` (the old file name), `source_commit` (the commit that added
  it), `time_utc` of that commit, and null `git_sha` / `command` / `machine`. A run log is a
  record of `gpu_checks` with `result: {"step": ..., "exit_code": ..., "seconds": ..., "log":
  "<text>"}` (`python benchmarks/_harness.py LOG --step NAME --out FILE`, as gpu_checks.sh does).
  `read_records(path)` reads a file back, `last_record(path, label)` its newest record of a
  label. Outside a git checkout (a GPU machine given a copy of
  the tree) set `TESSEL_GIT_SHA`.
- Real model: `example_model()` is SmolLM2-135M-Instruct from `tessel example-model`
  (`tessel.example_models.decoder`), `example_gguf()` its GGUF file; `tests_module(name)` loads a
  helper of tests/ (tiny_models, decode_steps) by its file path.

`import _harness` loads only the standard library (tessel and torch when first used), so a
benchmark's own process (its peak RSS, its imports) is what it was without the harness.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent
REPO = BENCHMARKS.parent
RESULTS = BENCHMARKS / "results"
TESTS = REPO / "tests"
GIT_SHA_ENV = "TESSEL_GIT_SHA"
PARTIAL_SUFFIX = ".partial.tmp"  # benchmarks/results/*.tmp is git-ignored
# ISA extensions that decide tessel's CPU paths -> the /proc/cpuinfo flags that show them
ISA_FLAGS = {
    "avx2": ("avx2",),
    "avx512": ("avx512f",),
    "vnni": ("avx512_vnni", "avx_vnni"),
    "avx512_bf16": ("avx512_bf16",),
    "amx": ("amx_tile", "amx_int8", "amx_bf16"),
}


# ---- timer ---------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Timing:
    """Seconds per call of each timed run."""

    runs_s: tuple[float, ...]

    @property
    def median_s(self) -> float:
        return statistics.median(self.runs_s)

    @property
    def min_s(self) -> float:
        return min(self.runs_s)

    @property
    def median_ms(self) -> float:
        return self.median_s * 1e3

    @property
    def min_ms(self) -> float:
        return self.min_s * 1e3


def time_calls(
    fns: Mapping[str, Callable[[], object]],
    *,
    warmup: int = 1,
    repeats: int = 5,
    clock: str = "wall",
    calls: int = 1,
) -> dict[str, Timing]:
    """name -> Timing of each callable, timed interleaved: `warmup` untimed rounds, then `repeats`
    rounds of one timed run of each; a run is `calls` calls (its seconds are per call)."""
    from tessel.profiling.timing import make_clock, time_runs

    names = list(fns)
    runs = [_repeated(fns[name], calls) for name in names]
    seconds = time_runs(runs, make_clock(clock), warmup=warmup, repeats=repeats)
    return {name: Timing(tuple(s / calls for s in times)) for name, times in zip(names, seconds, strict=True)}


def time_call(fn: Callable[[], object], **options) -> Timing:
    """`time_calls` of one callable."""
    return time_calls({"": fn}, **options)[""]


def _repeated(fn: Callable[[], object], calls: int) -> Callable[[], object]:
    if calls == 1:
        return fn

    def run() -> None:
        for _ in range(calls):
            fn()

    return run


@dataclass(slots=True)
class Elapsed:
    wall_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time (all its threads)


@contextlib.contextmanager
def stopwatch() -> Iterator[Elapsed]:
    """Wall and process CPU seconds of the block (set when it ends, also when it raises)."""
    elapsed = Elapsed()
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        yield elapsed
    finally:
        elapsed.wall_s, elapsed.cpu_s = time.perf_counter() - wall, time.process_time() - cpu


# ---- machine -------------------------------------------------------------------------------------
def machine() -> dict:
    """This machine as a benchmark record states it: CPU, GPU, torch (where it imports), load now."""
    info = {**_hardware(), "load_average": list(os.getloadavg())}
    if "torch" in info:
        import torch

        info["torch_threads"] = torch.get_num_threads()
    return info


@functools.cache
def _hardware() -> dict:
    info: dict = {
        "cpu": {
            "name": platform.processor() or platform.machine(),
            "model": _cpu_model(),
            "cores": os.cpu_count(),
        },
        "platform": platform.platform(),
        "python": platform.python_version(),
        "gpu": None,
    }
    try:
        import torch
    except ImportError:  # the planner-side benchmarks run without the runtime extra
        return info
    from tessel.kernels.cpu_features import cpu_summary

    features = cpu_summary()
    flags = set(features["flags"])
    info["cpu"]["isa"] = {name: bool(flags & set(names)) for name, names in ISA_FLAGS.items()}
    info["cpu"].update(features)
    info["torch"] = torch.__version__
    if torch.cuda.is_available():
        info["gpu"] = {"name": torch.cuda.get_device_name(0), "cuda": torch.version.cuda}
    return info


def machine_line() -> str:
    """The machine in one console line: CPU, ISA, paths, GPU, torch."""
    info = machine()
    cpu = info["cpu"]
    text = f"CPU: {cpu['model'] or cpu['name']}, {cpu['cores']} cores"
    if "isa" in cpu:
        isa = [name for name, present in cpu["isa"].items() if present] or ["none of AVX2/AVX-512/AMX"]
        text += (
            f"; ISA {', '.join(isa)}; PyTorch capability {cpu['torch_cpu_capability']}; "
            f"int8 path {cpu['int8_path']} ({cpu['int8_path_7bit_weight_codes']} for 7-bit weight codes), "
            f"W8A16 path {cpu['w8a16_path']}; torch {info['torch']}, {info['torch_threads']} thread(s)"
        )
    gpu = info["gpu"]
    return text + (f"; GPU: {gpu['name']} (CUDA {gpu['cuda']})" if gpu else "; no GPU")


def _cpu_model() -> str | None:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


# ---- git -----------------------------------------------------------------------------------------
@functools.cache
def git_state() -> tuple[str | None, bool | None]:
    """(HEAD's sha, whether tracked files differ from it); `TESSEL_GIT_SHA` where there is no checkout."""
    if os.environ.get(GIT_SHA_ENV):
        return os.environ[GIT_SHA_ENV], None
    try:
        sha = _git("rev-parse", "HEAD")
        dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return sha, dirty


def _git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True)
    return done.stdout.strip()


# ---- records -------------------------------------------------------------------------------------
def results_file(benchmark: str) -> Path:
    return RESULTS / f"{benchmark}.jsonl"


def add_record_options(parser: argparse.ArgumentParser, benchmark: str, flag: str = "--out") -> None:
    """`--out` (the JSON-lines file this run's record is appended to) and `--label`."""
    parser.add_argument(
        flag,
        type=Path,
        default=results_file(benchmark),
        help=f"JSON-lines file to append this run's record to (default: {_shown(results_file(benchmark))})",
    )
    parser.add_argument("--label", default="", help="a name for this run's record (the machine, the change)")


def add_size_options(parser: argparse.ArgumentParser, full: dict[str, int]) -> None:
    """An integer option per key of a benchmark's full settings (`--profile-budget-s` for
    `profile_budget_s`), to override one setting of a run; `sizes` reads them back."""
    for key, value in full.items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=int, help=f"override (full: {value})")


def sizes(args: argparse.Namespace, base: dict[str, int]) -> dict[str, int]:
    """`base` (the full or quick settings) with the `add_size_options` the command line gave."""
    return {
        key: value if getattr(args, key, None) is None else getattr(args, key) for key, value in base.items()
    }


def record(benchmark: str, result: object, label: str = "") -> dict:
    """A record of this run (see the module docstring)."""
    sha, dirty = git_state()
    return {
        "benchmark": benchmark,
        "label": label,
        "time_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "git_sha": sha,
        "git_dirty": dirty,
        "command": shlex.join(["python", _shown(Path(sys.argv[0])), *sys.argv[1:]]),
        "machine": machine(),
        "result": result,
    }


def append_record(path: Path, benchmark: str, result: object, label: str = "") -> Path:
    """Append this run's record as one line to `path` (created with its folder); the partial record
    `save_partial` kept beside it is removed."""
    append_line(path, record(benchmark, result, label))
    partial = _partial_path(path)
    if partial.exists():
        partial.unlink()
    print(f"appended a record to {_shown(path)}", file=sys.stderr)
    return path


def append_line(path: Path, item: dict) -> None:
    """One JSON object as one line at the end of `path` (non-finite floats as null)."""
    from tessel.files import jsonable

    line = json.dumps(jsonable(item), default=_json_default, ensure_ascii=False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a+b") as handle:
        handle.seek(0, os.SEEK_END)
        if handle.tell():  # a file cut short of its newline still gets one line per record
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                handle.write(b"\n")
        handle.write(line.encode("utf-8") + b"\n")


def save_partial(path: Path, benchmark: str, result: object, label: str = "") -> None:
    """The record so far, beside `path` (`<file>.partial.tmp`), for a run that may not finish (a
    GPU step under a time limit); `append_record` removes it."""
    from tessel.files import jsonable

    partial = _partial_path(path)
    partial.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(jsonable(record(benchmark, result, label)), default=_json_default, indent=1)
    partial.write_text(text + "\n", encoding="utf-8")


def read_records(path: Path) -> list[dict]:
    """The records of a JSON-lines results file, oldest first."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def last_record(path: Path, label: str) -> dict:
    """The newest record labelled `label` in a results file (exits naming both when there is none)."""
    records = [r for r in read_records(path) if r.get("label") == label]
    if not records:
        raise SystemExit(f"no record labelled {label!r} in {path}")
    return records[-1]


def _partial_path(path: Path) -> Path:
    return Path(path).with_name(Path(path).name + PARTIAL_SUFFIX)


def _json_default(value: object) -> object:
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        return value.item()
    if hasattr(value, "tolist") and callable(value.tolist):
        return value.tolist()
    return str(value)  # paths, dtypes


def _shown(path: Path) -> str:
    """A path relative to the repository when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


# ---- models --------------------------------------------------------------------------------------
def example_model(path: str | Path | None = None) -> Path:
    """`path`, or SmolLM2-135M-Instruct from `tessel example-model` (built once; progress to stderr)."""
    if path:
        return Path(path)
    from tessel.example_models.decoder import example_model_dir

    return example_model_dir(progress=lambda message: print(message, file=sys.stderr, flush=True))


def example_gguf() -> Path:
    """The example model's GGUF file (Q4_1), downloaded once."""
    from tessel.example_models import decoder

    return decoder.example_gguf(progress=lambda message: print(message, file=sys.stderr, flush=True))


def tests_module(name: str) -> ModuleType:
    """A helper module of tests/ (`tiny_models`, `decode_steps`), loaded from its file: the benchmarks
    build random-weight checkpoints and teacher-force decode steps as the tests do."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, TESTS / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"no helper {name!r} in {TESTS}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


# ---- command line: a run log as a record (benchmarks/gpu_checks.sh) -------------------------------
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Append a run log to a results file as one record.")
    parser.add_argument("log", type=Path, help="the log file")
    parser.add_argument("--benchmark", default="gpu_checks")
    parser.add_argument("--step", required=True, help="what the log is of (cuda_tests, cuda_engine, ...)")
    parser.add_argument("--exit-code", type=int, default=None)
    parser.add_argument("--seconds", type=float, default=None)
    add_record_options(parser, "gpu_checks")
    args = parser.parse_args(argv)
    text = args.log.read_text(encoding="utf-8", errors="replace")
    result = {"step": args.step, "exit_code": args.exit_code, "seconds": args.seconds, "log": text}
    append_record(args.out, args.benchmark, result, args.label)


if __name__ == "__main__":
    main()
