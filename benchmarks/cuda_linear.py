"""tessel's CUDA linears on Llama-3.2-1B's shapes, and where the W8A8 engine's time goes at 32
requests; print tables, write JSON.

    python benchmarks/cuda_linear.py [--parts engine,profile,linears] [--new-tokens 32] \
        [--budget-s 85] [--out benchmarks/results/cuda_linear.jsonl] [--label NAME]

Issue 29: on an H200, `benchmarks/cuda_engine.py --shape llama-1b` (one timed run per phase) gave
the W8A8 and W8A16 engines 0.30x float16's tok/s at 32 requests, and 1.7-1.9x at one stream.
Each timed run there follows one warm-up run of the same prompts, so the prefix cache holds 112
of each prompt's 128 tokens: the timed 32-request run prefills 32 x 16 = 512 rows, a row count
(`bucket_m` 512) that neither `warm_up()` (decode buckets) nor the warm-up run (2048-row chunks)
met, and tessel's GEMMs tune their tiles the first time they meet a shape key, inside the timed
run (float16's linears are cuBLAS's, which does not tune). The attention kernels tune the same way
for every engine (the one-stream timed run's prefill, 16 new tokens over 112 cached, is a new
flash-attention key); there the float16 row, run first, paid for the rows after it, which found
its keys in the cache. This script tells tuning apart from a slow kernel, in three parts, each
within what is left of `--budget-s`:

1. engine: float16, W8A8, and W8A8 with `tune_linears` after `warm_up()`, with random weights
   of Llama-1B's shapes (built on the GPU; no checkpoint on disk), run as cuda_engine.py does:
   one stream twice, then 32 requests three times (128-token prompts, `--new-tokens` each). Per
   run: wall seconds, tok/s, and what the autotuner spent in it (`tuning_totals()` before and
   after, per kernel: shape keys benchmarked, seconds). Each engine starts with no tiles tuned
   (an empty cache folder), as a new process on a new machine. Tuning inside "32 requests, timed
   1" and none in "timed 2" means the slowdown was tuning, and "timed 2" is the steady state.
2. profile: one 32-row decode step of the float16 and W8A8 engines under torch.profiler, as
   replayed from its CUDA graph and again eagerly: the CUDA kernels that take the time.
3. linears: qkv 2048->3072, o 2048->2048, gate_up 2048->16384, down 8192->2048 and the LM head
   2048->128256 at 1, 8, 16, 32 and 64 rows: float16 F.linear (cuBLAS); W8A8Linear on each CUDA
   path (Triton: quantize_per_token + int8_gemm; the torch backend: float64 sums up to 16 rows,
   torch._int_mm above); int8_gemm alone; W8A16Linear (Triton w8a16_gemm; torch backend:
   de-quantise then matmul); torch._int_mm and torch._scaled_mm (fp8 e4m3, row-wise scales)
   where they take the shape. Each is timed as a CUDA graph of calls cycling over enough copies
   of the weight to overflow the L2 cache (a decode step streams every weight once), so the
   times are GPU time without Python launch overhead. The tile the autotuner chose per shape
   key and the seconds a new key's first call took are recorded too.

On request (`--parts tiles`, not in the default run): every tile candidate of the int8 and W8A16
GEMMs (`tessel.kernels.autotune`), each checked against a float64 product and timed as above, on
the decoder's four linears at 1 and 32 rows; the best tile per shape, and whether it is one of the
decode tiles (`INT8_DECODE_TILES`, `FLOAT_DECODE_TILES`).

Each run appends a record to benchmarks/results/cuda_linear.jsonl (the figures so far are kept
beside it after every part, should a later one hang).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import json
import math
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import _harness
import torch
import torch.nn.functional as F

LLAMA_1B = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 2048,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
LINEAR_SHAPES = {  # name -> (in_features K, out_features N)
    "qkv": (2048, 3072),
    "o": (2048, 2048),
    "gate_up": (2048, 16384),
    "down": (8192, 2048),
    "head": (2048, 128256),
}
ROWS = (1, 8, 16, 32, 64)
PROMPT_TOKENS = 128
BATCH = 32
MAX_MODEL_LEN = 512
ENGINES = {  # name -> (weights, tune_linears after warm_up)
    "float16": ("fp16", False),
    "W8A8": ("w8a8", False),
    "W8A8 + tune_linears": ("w8a8", True),
}
PROFILED = ("float16", "W8A8")
PARTS = ("engine", "profile", "linears", "tiles")
DEFAULT_PARTS = ("engine", "profile", "linears")
TILE_ROWS = (1, 32)
# A timed graph cycles over copies of a weight until they hold this many bytes (float16), past the
# H100/H200 L2 cache (50 / 60 MB), so each call reads its weight from HBM as in a decode step.
STREAM_BYTES = 256 * 2**20
MAX_COPIES = 32
MIN_CALLS = 8  # calls per timed graph at least (one graph replay is the timed unit)
TOP_KERNELS = 12
DEVICE = "cuda"


# ---- shared ----------------------------------------------------------------------------------------
class Budget:
    """What is left of the run's seconds; a part that would start past it is skipped, named."""

    def __init__(self, seconds: float) -> None:
        self.deadline = time.perf_counter() + seconds

    def left_s(self) -> float:
        return self.deadline - time.perf_counter()


def tuning_now() -> dict[str, tuple[int, float]]:
    from tessel.kernels.autotune import tuning_totals

    return {k: (t.benchmarks, t.seconds) for k, t in tuning_totals().items()}


def tuning_since(before: dict[str, tuple[int, float]]) -> dict[str, dict[str, float]]:
    """kernel -> {keys, seconds} benchmarked since `before` (kernels that tuned nothing left out)."""
    out = {}
    for kernel, (keys, seconds) in tuning_now().items():
        keys0, seconds0 = before.get(kernel, (0, 0.0))
        if keys > keys0:
            out[kernel] = {"keys": keys - keys0, "seconds": seconds - seconds0}
    return out


def fresh_tuning(directory: Path) -> None:
    """Forget every tile tuned so far, in memory and on disk (a new, empty TESSEL_CACHE_DIR): each
    engine, and the linears, then meet the autotuner as a new process on a new machine would."""
    from tessel.kernels import autotune

    directory.mkdir(parents=True, exist_ok=True)
    os.environ[autotune.CACHE_DIR_ENV] = str(directory)
    for tuner in autotune._ALL_TUNERS:
        tuner._memory.clear()


def tuned_tiles() -> dict[str, dict[str, dict]]:
    """kernel -> shape key -> the tile this process's autotuner holds for the GEMMs."""
    tuners = {
        "int8_gemm": importlib.import_module("tessel.kernels.int8_gemm")._TUNER,
        **importlib.import_module("tessel.kernels.w8a16_gemm")._TUNERS,
    }
    return {
        name: {key: config.to_dict() for (_, key), config in tuner._memory.items()}
        for name, tuner in tuners.items()
    }


# ---- 1. engine -------------------------------------------------------------------------------------
def model_dir(root: Path) -> Path:
    """A model directory with Llama-1B's config.json and a tokenizer (the weights are made on the GPU)."""
    tiny_models = _harness.tests_module("tiny_models")
    small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4}
    path = tiny_models.make_tiny_checkpoint(
        root / "llama-1b", "llama", tie_word_embeddings=True, num_kv_heads=2, seed=0,
        vocab_size=LLAMA_1B["vocab_size"], max_position_embeddings=2048, **small,
    )  # fmt: skip
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config.update(LLAMA_1B)
    config_file.write_text(json.dumps(config, indent=1))
    return path


def random_model(path: Path, dtype: torch.dtype, device: str, weights: str):
    """Llama-1B with random weights made on `device`; "w8a8": the decoder's linears rounded per
    output channel to W8A8Linear (what `tessel quantize --scheme w8a8` writes and the loader swaps in)."""
    from tessel.layers.linear import W8A8Linear, W8A16Linear
    from tessel.models.config import ModelConfig
    from tessel.models.llama import LlamaForCausalLM

    config = ModelConfig.from_dir(path)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(old)
    model = model.to_empty(device=device)
    model.lm_head.tie(model.model.embed_tokens)
    model.model.rotary.build_tables(device)
    generator = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.fill_(1.0)  # the norms
            else:
                param.normal_(0.0, 0.02, generator=generator)
    swap = {"w8a8": W8A8Linear, "w8a16": W8A16Linear}.get(weights)
    if swap is not None:
        for layer in model.model.layers:
            halves = ((layer.self_attn, ("qkv_proj", "o_proj")), (layer.mlp, ("gate_up_proj", "down_proj")))
            for owner, names in halves:
                for name in names:
                    setattr(owner, name, swap.from_linear(getattr(owner, name)))
    return model.eval().requires_grad_(False)


def make_engine(path: Path, weights: str):
    from tessel import LLM

    class RandomWeightsLLM(LLM):
        def _load_model(self, _path: Path):
            return random_model(_path, self.dtype, self.config.device, weights)

    return RandomWeightsLLM(
        path, device=DEVICE, dtype=torch.float16, max_model_len=MAX_MODEL_LEN, max_num_seqs=BATCH
    )


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return torch.randint(10, vocab, (BATCH, PROMPT_TOKENS), generator=g).tolist()


def timed_run(llm, batch: list[list[int]], new_tokens: int) -> dict:
    from tessel import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    graphs = getattr(llm.runner, "cuda_graphs", None)
    replays = graphs.replays if graphs is not None else 0
    before = tuning_now()
    torch.cuda.synchronize()
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_progress=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    assert all(len(o.token_ids) == new_tokens for o in outputs)
    return {
        "wall_s": wall,
        "tok_s": len(batch) * new_tokens / wall,
        "tuning": tuning_since(before),
        "graph_replays": (graphs.replays - replays) if graphs is not None else None,
    }


RUNS = (  # (run name, prompts): cuda_engine.py's order, one warm-up run before each timed one
    ("one stream, warm-up", 1),
    ("one stream, timed", 1),
    ("32 requests, warm-up", BATCH),
    ("32 requests, timed 1", BATCH),
    ("32 requests, timed 2", BATCH),
)


def engine_part(
    path: Path, names: list[str], new_tokens: int, profile: bool, budget: Budget, scratch: Path
) -> tuple[dict, dict]:
    from tessel.layers.linear import tune_linears

    batch = prompts(LLAMA_1B["vocab_size"])
    results, profiles = {}, {}
    for name in names:
        if budget.left_s() < 10:
            results[name] = {"skipped": f"budget: {budget.left_s():.0f} s left"}
            continue
        weights, pretune = ENGINES[name]
        fresh_tuning(scratch / f"tessel-cache-{weights}-{int(pretune)}")
        before = tuning_now()
        start = time.perf_counter()
        llm = make_engine(path, weights)
        build_s = time.perf_counter() - start
        start = time.perf_counter()
        llm.warm_up()
        warm_up_s = time.perf_counter() - start
        row = {"build_s": build_s, "warm_up_s": warm_up_s, "warm_up_tuning": tuning_since(before)}
        if pretune:
            before = tuning_now()
            start = time.perf_counter()
            tuned = tune_linears(llm.model, llm.scheduler.config.max_num_batched_tokens, torch.float16)
            seconds = time.perf_counter() - start
            row["tune_linears"] = {"seconds": seconds, "gemms": len(tuned), "tuning": tuning_since(before)}
        row["runs"] = {run: timed_run(llm, batch[:count], new_tokens) for run, count in RUNS}
        row["tiles"] = tuned_tiles()
        results[name] = row
        print_engine_row(name, row)
        if profile and name in PROFILED and budget.left_s() > 5:
            profiles[name] = profile_decode_step(llm, batch, new_tokens)
            print_profile(name, profiles[name])
        del llm
        torch.cuda.empty_cache()
    return results, profiles


def print_engine_row(name: str, row: dict) -> None:
    print(f"\n{name}: built in {row['build_s']:.1f} s, warm_up {row['warm_up_s']:.1f} s "
          f"(tuning {fmt_tuning(row['warm_up_tuning'])})")  # fmt: skip
    if "tune_linears" in row:
        t = row["tune_linears"]
        print(f"  tune_linears: {t['gemms']} GEMMs in {t['seconds']:.1f} s ({fmt_tuning(t['tuning'])})")
    print(f"  {'run':<22} {'wall s':>8} {'tok/s':>9} {'replays':>8}  tuning inside the run")
    for run, r in row["runs"].items():
        figures = f"{r['wall_s']:>8.3f} {r['tok_s']:>9.1f} {r['graph_replays']!s:>8}"
        print(f"  {run:<22} {figures}  {fmt_tuning(r['tuning'])}")


def fmt_tuning(tuning: dict) -> str:
    if not tuning:
        return "none"
    return ", ".join(f"{k}: {v['keys']} keys {v['seconds']:.2f} s" for k, v in sorted(tuning.items()))


# ---- 2. profile ------------------------------------------------------------------------------------
def profile_decode_step(llm, batch: list[list[int]], new_tokens: int) -> dict:
    """One 32-row decode step as its CUDA graph replays it, then one run eagerly (after an unprofiled
    eager step: the eager step's block tables are narrower than the graph's, a new paged-attention
    key, whose tuning, do_bench's L2-clearing fills included, would fill the table otherwise)."""
    from torch.profiler import ProfilerActivity, profile

    from tessel import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max(new_tokens, 8), ignore_eos=True)
    last: list = []
    schedule = llm.scheduler.schedule

    def recording_schedule():
        out = schedule()
        last[:] = [out]
        return out

    llm.scheduler.schedule = recording_schedule
    for i, prompt in enumerate(batch):
        llm.add_request(f"profile-{i}", prompt, params)

    def pure_decode() -> bool:
        return bool(last) and not last[0].prefills and len(last[0].decodes) == len(batch)

    while not pure_decode():  # the prefill step(s), then the first full decode step
        llm.step()
    result = {}
    plan = getattr(llm.runner, "plan", None)
    for mode in ("graph", "eager"):
        graphs = plan.cuda_graphs if plan is not None else None
        if mode == "eager":
            if graphs is None:
                result[mode] = {"skipped": "no step plan to switch the graphs off"}
                continue
            plan.cuda_graphs = None  # these steps run eagerly
        try:
            if mode == "eager":
                llm.step()  # unprofiled: its kernels' new keys (eager block tables) tune here
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                llm.step()
                torch.cuda.synchronize()
        finally:
            if mode == "eager":
                plan.cuda_graphs = graphs
        result[mode] = kernel_table(prof)
        result[mode]["pure_decode_rows"] = len(last[0].decodes) if pure_decode() else None
    while llm.has_unfinished_requests():
        llm.step()
    llm.scheduler.schedule = schedule
    return result


def device_time_us(event) -> float:
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def kernel_table(prof) -> dict:
    """The CUDA kernels of a profiled step, by their own GPU time: the top ones, and the totals."""
    kernels = []
    for event in prof.key_averages():
        us = device_time_us(event)
        device = str(getattr(event, "device_type", ""))
        if us > 0 and "CUDA" in device.upper():
            kernels.append({"kernel": event.key[:90], "calls": event.count, "us": us})
    kernels.sort(key=lambda k: -k["us"])
    total = sum(k["us"] for k in kernels)
    return {"total_kernel_us": total, "kernels": len(kernels), "top": kernels[:TOP_KERNELS]}


def print_profile(name: str, result: dict) -> None:
    for mode, table in result.items():
        if "skipped" in table:
            print(f"\n{name}, 32-row decode step ({mode}): skipped, {table['skipped']}")
            continue
        print(f"\n{name}, 32-row decode step ({mode}; rows {table['pure_decode_rows']}): "
              f"{table['total_kernel_us']:.0f} us of kernels, {table['kernels']} distinct")  # fmt: skip
        for k in table["top"]:
            print(f"  {k['us']:>9.1f} us {k['calls']:>5}x  {k['kernel']}")


# ---- 3. linears ------------------------------------------------------------------------------------
def graph_us(fns: list[Callable[[], object]], calls: int) -> float:
    """GPU microseconds per call of `calls` calls cycling over `fns`, captured as one CUDA graph."""
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    timing = _harness.time_call(graph.replay, warmup=1, repeats=5, clock="cuda")
    del graph
    return timing.median_s * 1e6 / calls


@contextlib.contextmanager
def kernel_backend(name: str | None) -> Iterator[None]:
    """TESSEL_KERNEL_BACKEND=name inside the block (None: as it is). The kernels read it per call, so
    a graph captured inside keeps the path it was captured with."""
    old = os.environ.get("TESSEL_KERNEL_BACKEND")
    if name is not None:
        os.environ["TESSEL_KERNEL_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TESSEL_KERNEL_BACKEND", None)
        else:
            os.environ["TESSEL_KERNEL_BACKEND"] = old


class ShapeWeights:
    """One linear shape's weights, `copies` times (float16, int8 codes, the W8A8 / W8A16 layers)."""

    def __init__(self, k: int, n: int, copies: int) -> None:
        from tessel.layers.linear import W8A8Linear, W8A16Linear, quantize_int8_weight

        gen = torch.Generator(device=DEVICE).manual_seed(0)
        w16 = torch.randn(n, k, device=DEVICE, dtype=torch.float16, generator=gen) * 0.02
        w8, self.scale = quantize_int8_weight(w16)
        self.k, self.n, self.copies = k, n, copies
        self.fp16 = [w16] + [w16.clone() for _ in range(copies - 1)]
        self.int8 = [w8] + [w8.clone() for _ in range(copies - 1)]
        self.w8a8 = [W8A8Linear(w, self.scale) for w in self.int8]
        self.w8a16 = [W8A16Linear(w, self.scale) for w in self.int8]


def providers(w: ShapeWeights, rows: int) -> dict[str, tuple[str | None, Callable[[], list]]]:
    """name -> (kernel backend, a builder of one call per weight copy). Built lazily: a provider that
    cannot take the shape raises there or on its first call, and is recorded as such."""
    from tessel.kernels import int8_gemm, quantize_per_token

    gen = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(rows, w.k, device=DEVICE, dtype=torch.float16, generator=gen)
    q, sq = quantize_per_token(x)
    copies, s8 = range(w.copies), w.scale

    def each(call: Callable[[int], object]) -> Callable[[], list]:
        return lambda: [functools.partial(call, i) for i in copies]

    def scaled_mm() -> list:
        if not hasattr(torch, "_scaled_mm") or torch.cuda.get_device_capability() < (8, 9):
            raise RuntimeError("fp8 torch._scaled_mm needs sm_89+")
        x8 = x.to(torch.float8_e4m3fn)
        w8s = [t.to(torch.float8_e4m3fn) for t in w.fp16]
        sa, sb = torch.ones(rows, 1, device=DEVICE), torch.ones(1, w.n, device=DEVICE)

        def call(i: int) -> torch.Tensor:
            return torch._scaled_mm(x8, w8s[i].t(), sa, sb, out_dtype=torch.bfloat16)  # row-wise: bf16 out

        return [functools.partial(call, i) for i in copies]

    return {
        "fp16 F.linear (cuBLAS)": (None, each(lambda i: F.linear(x, w.fp16[i]))),
        "W8A8Linear triton (quantize+int8_gemm)": ("triton", each(lambda i: w.w8a8[i](x))),
        "int8_gemm alone (triton, codes given)": ("triton", each(lambda i: int8_gemm(q, w.int8[i], sq, s8))),
        "W8A8Linear torch (fp64 <=16 rows|_int_mm)": ("torch", each(lambda i: w.w8a8[i](x))),
        "W8A16Linear triton (w8a16_gemm)": ("triton", each(lambda i: w.w8a16[i](x))),
        "W8A16Linear torch (dequant + mm)": ("torch", each(lambda i: w.w8a16[i](x))),
        "torch._int_mm (int32 out)": (None, each(lambda i: torch._int_mm(q, w.int8[i].t()))),
        "torch._scaled_mm fp8 (row-wise)": (None, scaled_mm),
    }


def linear_part(budget: Budget) -> dict:
    results: dict[str, dict] = {}
    for shape, (k, n) in LINEAR_SHAPES.items():
        if budget.left_s() < 5:
            results[shape] = {"skipped": f"budget: {budget.left_s():.0f} s left"}
            continue
        copies = max(1, min(MAX_COPIES, math.ceil(STREAM_BYTES / (2 * n * k))))
        weights = ShapeWeights(k, n, copies)
        cells: dict[str, dict] = {}
        for rows in ROWS:
            if budget.left_s() < 3:
                cells[str(rows)] = {"skipped": "budget"}
                continue
            cell: dict[str, dict] = {}
            for name, (backend, build) in providers(weights, rows).items():
                before = tuning_now()
                try:
                    with kernel_backend(backend):
                        fns = build()
                        start = time.perf_counter()
                        fns[0]()
                        torch.cuda.synchronize()
                        first_s = time.perf_counter() - start
                        us = graph_us(fns, max(MIN_CALLS, copies))
                    cell[name] = {"us": us, "first_call_s": first_s, "tuning": tuning_since(before)}
                except Exception as error:  # a provider that cannot take the shape is a row, not a stop
                    cell[name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"}
            cells[str(rows)] = cell
        results[shape] = {"k": k, "n": n, "copies": copies, "rows": cells}
        print_linear_shape(shape, results[shape])
        del weights
        torch.cuda.empty_cache()
    return results


def print_linear_shape(shape: str, result: dict) -> None:
    cells = {r: c for r, c in result["rows"].items() if "skipped" not in c}
    names = list(dict.fromkeys(name for cell in cells.values() for name in cell))
    print(f"\n{shape} {result['k']}->{result['n']} ({result['copies']} weight copies per graph): "
          "GPU us per call (vs fp16)")  # fmt: skip
    print(f"  {'path':<42}" + "".join(f"{'M=' + r:>17}" for r in cells))
    for name in names:
        line = f"  {name:<42}"
        for cell in cells.values():
            c, base = cell.get(name, {}), cell.get("fp16 F.linear (cuBLAS)", {}).get("us")
            if "us" in c:
                line += f"{c['us']:>9.1f}" + (f" ({c['us'] / base:.2f}x)" if base else " " * 8)
            else:
                line += f"{'n/a':>17}"
        print(line)
    tuned = [
        (name, c["first_call_s"]) for cell in cells.values() for name, c in cell.items() if c.get("tuning")
    ]
    if tuned:
        print("  first calls that tuned a new key, s: " + ", ".join(f"{n} {t:.2f}" for n, t in tuned))


# ---- 4. tiles (on request) ----------------------------------------------------------------------------
def tile_part(budget: Budget) -> dict:
    """Every int8 / W8A16 tile candidate on the decoder's linears at TILE_ROWS rows: GPU us per
    call (None: the tile does not compile or run here) and whether its output matched float64."""
    from tessel.kernels import gemm
    from tessel.kernels.autotune import (
        FLOAT_DECODE_TILES,
        FLOAT_GEMM_CONFIGS,
        INT8_DECODE_TILES,
        INT8_GEMM_CONFIGS,
    )
    from tessel.kernels.quantize_rows import quantize_per_token

    kernels = {  # name -> (candidates, decode tiles, DOT mode, whether `a` is the int8 codes)
        "int8_gemm": (INT8_GEMM_CONFIGS, INT8_DECODE_TILES, "int8", True),
        "w8a16_gemm": (FLOAT_GEMM_CONFIGS, FLOAT_DECODE_TILES, "native", False),
    }
    results: dict[str, dict] = {}
    for shape, (k, n) in LINEAR_SHAPES.items():
        if shape == "head" or budget.left_s() < 5:
            continue
        copies = max(1, min(MAX_COPIES, math.ceil(STREAM_BYTES / (2 * n * k))))
        weights = ShapeWeights(k, n, copies)
        for rows in TILE_ROWS:
            x = torch.randn(rows, k, device=DEVICE, dtype=torch.float16)
            q, sq = quantize_per_token(x)
            for kernel, (configs, decode_tiles, dot, codes) in kernels.items():
                a, a_scale = (q, sq) if codes else (x, None)
                scale = a_scale.double()[:, None] if codes else 1.0
                ref = (a.double() @ weights.int8[0].double().t()) * scale * weights.scale.double()[None, :]
                out = torch.empty(rows, n, device=DEVICE, dtype=torch.float16)
                cell = {}
                for config in configs:
                    name = "{}x{}x{} w{} s{}".format(*(getattr(config, f) for f in TILE_FIELDS))
                    fns = [
                        functools.partial(_launch_tile, gemm, a, w, a_scale, weights.scale, out, dot, config)
                        for w in weights.int8
                    ]
                    try:
                        us = graph_us(fns, max(MIN_CALLS, copies))
                        fns[0]()
                        error = ((out.double() - ref).abs().max() / ref.abs().max()).item()
                    except Exception as err:  # a tile that does not fit this GPU: skipped, as the tuner does
                        cell[name] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:100]}"}
                        continue
                    cell[name] = {"us": us, "rel_error": error, "decode_tile": config in decode_tiles}
                results[f"{kernel} {shape} M={rows}"] = cell
                print_tiles(f"{kernel} {shape} {k}->{n} M={rows}", cell)
        del weights
        torch.cuda.empty_cache()
    return results


TILE_FIELDS = ("block_m", "block_n", "block_k", "num_warps", "num_stages")
# A tile's output against the float64 product, relative to its largest element: the int32 sums are
# exact and float16 rounds once (2**-11); W8A16's float16 products sum in float32.
TILE_REL_TOLERANCE = 2e-3


def _launch_tile(gemm, a, w, a_scale, w_scale, out, dot, config) -> None:
    (m, k), n = a.shape, w.shape[0]
    grid = (math.ceil(m / config.block_m) * math.ceil(n / config.block_n),)
    gemm._gemm_kernel[grid](
        a, w, out, out if a_scale is None else a_scale, w_scale, out, m, n, k,
        a.stride(0), a.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
        HAS_A_SCALE=a_scale is not None, HAS_W_SCALE=True, HAS_BIAS=False, DOT=dot, **config.meta(),
    )  # fmt: skip


def print_tiles(title: str, cell: dict) -> None:
    timed = sorted((c["us"], name) for name, c in cell.items() if "us" in c)
    wrong = [name for name, c in cell.items() if c.get("rel_error", 0.0) > TILE_REL_TOLERANCE]
    failed = [name for name, c in cell.items() if "error" in c]
    if not timed:
        print(f"{title}: no tile ran")
        return
    (best_us, best), tutorial = timed[0], [(us, nm) for us, nm in timed if not cell[nm]["decode_tile"]]
    kind = "decode tile" if cell[best]["decode_tile"] else "tutorial tile"
    line = f"{title}: best {best} {best_us:.1f} us ({kind})"
    if tutorial:
        line += f", best tutorial tile {tutorial[0][1]} {tutorial[0][0]:.1f} us"
    print(
        line
        + (f"; WRONG: {', '.join(wrong)}" if wrong else "")
        + (f"; did not run: {len(failed)}" if failed else "")
    )


# ---- main ------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--parts", default=",".join(DEFAULT_PARTS), help="comma-separated, of: " + ", ".join(PARTS))
    add("--engines", default=",".join(ENGINES), help="comma-separated, of: " + ", ".join(ENGINES))
    add("--new-tokens", type=int, default=32, help="new tokens per request in the engine runs")
    add("--budget-s", type=float, default=85.0, help="a part that would start past it is skipped")
    _harness.add_record_options(parser, "cuda_linear")
    args = parser.parse_args()
    parts = [p for p in args.parts.split(",") if p]
    engines = [e for e in args.engines.split(",") if e]
    unknown = [e for e in engines if e not in ENGINES] + [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"unknown engine or part: {', '.join(unknown)}")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/cuda_linear.py needs a CUDA GPU")
    budget = Budget(args.budget_s)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    print(f"host: {_harness.machine_line()}")
    record: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "model": LLAMA_1B,
        "workload": {"prompt_tokens": PROMPT_TOKENS, "new_tokens": args.new_tokens, "batch": BATCH},
        "parts": parts,
    }
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        if "engine" in parts or "profile" in parts:
            names = engines if "engine" in parts else [e for e in PROFILED if e in engines]
            record["engine"], record["profile"] = engine_part(
                model_dir(scratch), names, args.new_tokens, "profile" in parts, budget, scratch
            )
            summarize_engines(record["engine"])
            _harness.save_partial(args.out, "cuda_linear", record, args.label)
        if "linears" in parts:
            fresh_tuning(scratch / "tessel-cache-linears")
            record["linears"] = linear_part(budget)
            record["linear_tiles"] = tuned_tiles()
        if "tiles" in parts:
            record["tiles"] = tile_part(budget)
    record["budget_left_s"] = budget.left_s()
    print_summary(record)
    print(f"{budget.left_s():.0f} s of --budget-s left")
    _harness.append_record(args.out, "cuda_linear", record, args.label)


def summarize_engines(results: dict) -> None:
    """The ratios of issue 29: each engine's tok/s / float16's, in the first timed run (what
    cuda_engine.py --repeats 1 measured) and the second (no new shapes left: the steady state)."""
    base = results.get("float16", {}).get("runs")
    if not base:
        return
    print("\ntok/s vs float16 in the same run (timed 1: as cuda_engine.py --repeats 1; timed 2: steady)")
    for name, row in results.items():
        runs = row.get("runs")
        if not runs:
            continue
        ratio = {run: runs[run]["tok_s"] / base[run]["tok_s"] for run in runs}
        batch = f"timed 1 {ratio['32 requests, timed 1']:.2f}x, timed 2 {ratio['32 requests, timed 2']:.2f}x"
        print(f"  {name:<22} 32 requests: {batch}; one stream, timed {ratio['one stream, timed']:.2f}x")


def print_summary(record: dict) -> None:
    """The figures that decide issue 29's question, last (gpu_checks.sh shows a log's tail)."""
    print("\n== summary ==")
    engine = record.get("engine", {})
    base = engine.get("float16", {}).get("runs", {})
    for name, row in engine.items():
        runs = row.get("runs")
        if name == "float16" or not runs or not base:
            continue
        parts = []
        for run in ("32 requests, timed 1", "32 requests, timed 2", "one stream, timed"):
            r = runs[run]
            parts.append(f"{run} {r['tok_s'] / base[run]['tok_s']:.2f}x (tuning: {fmt_tuning(r['tuning'])})")
        print(f"{name} tok/s vs float16: " + "; ".join(parts))
    for rows in ("1", "32"):
        for path in ("W8A8Linear triton (quantize+int8_gemm)", "W8A16Linear triton (w8a16_gemm)"):
            ratios = []
            for shape, result in record.get("linears", {}).items():
                cell = result.get("rows", {}).get(rows, {}) if isinstance(result, dict) else {}
                us, base_us = cell.get(path, {}).get("us"), cell.get("fp16 F.linear (cuBLAS)", {}).get("us")
                if us and base_us:
                    ratios.append(f"{shape} {us / base_us:.2f}x")
            if ratios:
                print(f"{rows:>2} rows, {path} time / fp16's: " + ", ".join(ratios))
    for name, result in record.get("profile", {}).items():
        for mode, table in result.items():
            if "top" in table and table["top"]:
                top = table["top"][0]
                print(f"{name} 32-row decode step ({mode}): {table['total_kernel_us']:.0f} us of kernels; "
                      f"top {top['us']:.0f} us {top['kernel'][:60]}")  # fmt: skip


if __name__ == "__main__":
    main()
