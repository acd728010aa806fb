"""Time tessel's kernels against the PyTorch ops they replace; print a table, write JSON.

    python benchmarks/kernels.py [--quick] [--device cpu|cuda] [--out benchmarks/results/kernels.jsonl]

On CUDA every op is timed with `triton.testing.do_bench` (median of a 25 ms warm-up + 100 ms of
runs) against its torch baseline: fp16 matmul, torch._int_mm, SDPA, F.rms_norm, F.conv2d, ... On CPU
the CPU paths are timed against their float baselines with the harness's interleaved wall-clock
timer (median and min); the headline
is `W8A8Linear` (per-token quantisation, the int8 GEMM of the CPU's path, the epilogue) against fp32
`nn.Linear` at 256 x 4096 x 4096 (target: >= 2x), on the path this CPU chooses (`int_mm` with
AVX-512 VNNI, `fp16codes` with AVX2 only) and on fbgemm's two routes forced. Attention/norm ops from
other modules are imported lazily and skipped when absent. `speedup` = baseline time / tessel time.
Each run appends a record to benchmarks/results/kernels.jsonl.
"""

from __future__ import annotations

import argparse
import importlib
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass

import _harness
import torch
import torch.nn.functional as F


@dataclass(slots=True)
class Result:
    op: str
    shape: str
    dtype: str
    baseline: str
    tessel_ms: float  # median
    baseline_ms: float
    tessel_min_ms: float
    baseline_min_ms: float
    speedup: float  # baseline_ms / tessel_ms (medians): > 1 means tessel is faster
    speedup_min: float  # the same from the minimums, the steadier number on a loaded CPU


def cpu_pair_ms(tessel: Callable[[], object], baseline: Callable[[], object], repeats: int) -> list[float]:
    """[tessel median, baseline median, tessel min, baseline min] in ms, runs interleaved.

    Alternating the two ops spreads load changes on a shared CPU evenly over both.
    """
    timed = _harness.time_calls({"tessel": tessel, "baseline": baseline}, warmup=2, repeats=repeats)
    t, b = timed["tessel"], timed["baseline"]
    return [t.median_ms, b.median_ms, t.min_ms, b.min_ms]


def cuda_pair_ms(tessel: Callable[[], object], baseline: Callable[[], object], quick: bool) -> list[float]:
    import triton.testing

    def bench(fn: Callable[[], object]) -> list[float]:
        return triton.testing.do_bench(
            fn, warmup=10 if quick else 25, rep=40 if quick else 100, quantiles=[0.5, 0.0]
        )

    (t_med, t_min), (b_med, b_min) = bench(tessel), bench(baseline)
    return [t_med, b_med, t_min, b_min]


class Bench:
    """Times (tessel op, baseline op) pairs on one device and collects the Results."""

    def __init__(self, device: str, quick: bool) -> None:
        self.device = device
        self.quick = quick
        self.results: list[Result] = []

    def pair(
        self, op: str, shape: str, dtype: str, tessel: Callable, baseline_name: str, baseline: Callable
    ) -> None:
        if self.device == "cuda":
            t_med, b_med, t_min, b_min = cuda_pair_ms(tessel, baseline, self.quick)
        else:
            t_med, b_med, t_min, b_min = cpu_pair_ms(tessel, baseline, repeats=5 if self.quick else 15)
        self.results.append(
            Result(op, shape, dtype, baseline_name, t_med, b_med, t_min, b_min, b_med / t_med, b_min / t_min)
        )


def optional_op(name: str) -> Callable | None:
    """tessel.kernels.<name> when that op exists yet, else None (skipped)."""
    try:
        return getattr(importlib.import_module("tessel.kernels"), name)
    except (ImportError, AttributeError):
        return None


def check(name: str, got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    """Refuse to time an op that gives a wrong answer (relative Frobenius error)."""
    err = float((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-12))
    if err > rel:
        raise SystemExit(f"{name}: relative error {err:.2e} > {rel:.0e}; not timing a wrong kernel")


# (M, N, K): decode (1, 16 tokens), a 256-token prefill chunk, a Llama-7B MLP projection, long prefills.
CUDA_GEMM_SHAPES = [
    (1, 4096, 4096),
    (16, 4096, 4096),
    (256, 4096, 4096),
    (256, 11008, 4096),
    (2048, 4096, 4096),
    (4096, 4096, 4096),  # the README's CUDA target: int8 GEMM >= 1.8x fp16
]
CPU_GEMM_SHAPES = [(16, 4096, 4096), (256, 4096, 4096), (256, 11008, 4096)]
QUICK_GEMM_SHAPES = [(256, 4096, 4096)]  # the CPU target: W8A8Linear >= 2x fp32 nn.Linear here


def gemm_cases(bench: Bench) -> None:
    shapes = CUDA_GEMM_SHAPES if bench.device == "cuda" else CPU_GEMM_SHAPES
    if bench.quick:
        shapes = QUICK_GEMM_SHAPES
    for m, n, k in shapes:
        with torch.no_grad():
            gemm_shape(bench, m, n, k)


def gemm_shape(bench: Bench, m: int, n: int, k: int) -> None:
    """One GEMM shape: the W8A8 layer and its two halves, W8A16, and (CUDA) the float GEMM."""
    from tessel.kernels import int8_gemm, quantize_per_token
    from tessel.kernels.w8a16_gemm import linear
    from tessel.layers import W8A8Linear, W8A16Linear

    device = bench.device
    float_dtype = torch.float16 if device == "cuda" else torch.float32
    dtype_name = str(float_dtype).removeprefix("torch.")
    shape = f"{m}x{n}x{k}"
    x = torch.randn(m, k, device=device, dtype=float_dtype)
    ref = torch.nn.Linear(k, n, device=device, dtype=float_dtype)
    weight, bias = ref.weight.detach(), ref.bias.detach()
    base_name = f"F.linear {dtype_name}"

    def baseline() -> torch.Tensor:
        return F.linear(x, weight, bias)

    expected = baseline()
    int8_layer = W8A8Linear.from_linear(ref)
    check("W8A8Linear", int8_layer(x), expected, 0.05)
    path = int8_layer.cpu_path() if device == "cpu" else "cuda"
    bench.pair(f"W8A8Linear (W8A8, {path})", shape, "int8", lambda: int8_layer(x), base_name, baseline)
    if device == "cpu":  # fbgemm's two routes too, each forced (any x86 CPU runs them)
        for other in ("fp16codes", "fbgemm"):
            if other != path:
                layer = W8A8Linear.from_linear(ref)
                layer.set_path(other)
                check(f"W8A8Linear {other}", layer(x), expected, 0.05)
                name = f"W8A8Linear (W8A8, {other}{', 7-bit acts' if other == 'fbgemm' else ''})"
                bench.pair(name, shape, "int8", lambda layer=layer: layer(x), base_name, baseline)
        narrow = W8A8Linear.from_linear(ref, weight_code_bits=7)  # fbgemm with 8-bit activations on AVX2
        check("W8A8Linear 7-bit weight codes", narrow(x), expected, 0.05)
        name = f"W8A8Linear (W8A8, 7-bit weight codes, {narrow.cpu_path()})"
        bench.pair(name, shape, "int8", lambda: narrow(x), base_name, baseline)

    q, s = quantize_per_token(x)
    w_q, w_s, b32 = int8_layer.weight, int8_layer.weight_scale, int8_layer.bias

    def w8a8_gemm() -> torch.Tensor:
        return int8_gemm(q, w_q, s, w_s, b32, float_dtype)

    bench.pair(
        "  quantize_per_token", f"{m}x{k}", dtype_name, lambda: quantize_per_token(x), base_name, baseline
    )
    bench.pair("  int8_gemm", shape, "int8", w8a8_gemm, base_name, baseline)
    if device == "cpu" or (m > 16 and k % 8 == 0 and n % 8 == 0):  # CUDA _int_mm's shape rules
        bench.pair(
            "  int8_gemm",
            shape,
            "int8",
            w8a8_gemm,
            "torch._int_mm (no scales)",
            lambda: torch._int_mm(q, w_q.t()),
        )

    w8a16_layer = W8A16Linear.from_linear(ref)
    check("W8A16Linear", w8a16_layer(x), expected, 0.05)
    bench.pair("W8A16Linear", shape, "int8 w", lambda: w8a16_layer(x), base_name, baseline)
    if device == "cuda":
        check("linear", linear(x, weight, bias), expected, 1e-2)
        bench.pair("linear", shape, dtype_name, lambda: linear(x, weight, bias), base_name, baseline)


# SmolLM2-135M's decoder linears as the engine fuses them (N, K): qkv, o, gate_up, down.
SMOLLM2_LINEARS = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}


def smollm2_cases(bench: Bench) -> None:
    """One SmolLM2 decoder layer's four linears, run back to back, at 1 row (one-stream decode) and
    32 rows (32 requests decoding): W8A8Linear with 7-bit and with 8-bit weight codes on this CPU's
    paths, against fp32 F.linear. The end-to-end W8A8 / fp32 decode ratio of the engine cannot
    exceed this one by much, as everything outside the linears is the same code in both."""
    from tessel.layers import W8A8Linear

    refs = [torch.nn.Linear(k, n) for n, k in SMOLLM2_LINEARS.values()]
    narrow = [W8A8Linear.from_linear(ref, weight_code_bits=7) for ref in refs]
    full = [W8A8Linear.from_linear(ref) for ref in refs]
    for m in (1, 32):
        xs = [torch.randn(m, ref.in_features) for ref in refs]

        def run(layers, xs=xs) -> list[torch.Tensor]:
            return [layer(x) for layer, x in zip(layers, xs, strict=True)]

        for layers, bits in ((narrow, 7), (full, 8)):
            for got, want in zip(run(layers), run(refs), strict=True):
                check(f"W8A8Linear {bits}-bit codes", got, want, 0.05)
            name = f"SmolLM2 layer, W8A8Linear {bits}-bit codes ({layers[0].cpu_path()})"
            bench.pair(name, f"{m}x(qkv,o,gate_up,down)",
                       "int8", lambda layers=layers, run=run: run(layers), "F.linear float32",
                       lambda run=run: run(refs))  # fmt: skip


def other_cases(bench: Bench) -> None:
    from tessel.kernels import conv2d, transpose

    device, quick = bench.device, bench.quick
    dtype = torch.float16 if device == "cuda" else torch.float32
    name = str(dtype).removeprefix("torch.")

    x = torch.randn(4096, 4096 if device == "cuda" else 2048, device=device, dtype=dtype)
    check("transpose", transpose(x), x.t(), 0)
    bench.pair("transpose", "x".join(map(str, x.shape)), name, lambda: transpose(x), "x.t().contiguous()",
               lambda: x.t().contiguous())  # fmt: skip

    batch = 8 if device == "cuda" else 2
    img = torch.randn(batch, 64, 56, 56, device=device, dtype=dtype)
    w = torch.randn(128, 64, 3, 3, device=device, dtype=dtype) / 24
    check("conv2d", conv2d(img, w, padding=1), F.conv2d(img, w, padding=1), 1e-2)
    shape = f"{batch}x64x56x56 * 128x64x3x3"
    bench.pair(
        "conv2d",
        shape,
        name,
        lambda: conv2d(img, w, padding=1),
        "F.conv2d",
        lambda: F.conv2d(img, w, padding=1),
    )

    hidden = 4096
    rows = 256 if quick else 2048
    h = torch.randn(rows, hidden, device=device, dtype=dtype)
    gamma = torch.rand(hidden, device=device, dtype=dtype) + 0.5
    rms_norm = optional_op("rms_norm")
    if rms_norm is not None:
        check("rms_norm", rms_norm(h, gamma, 1e-6), F.rms_norm(h, (hidden,), gamma, 1e-6), 1e-2)
        bench.pair("rms_norm", f"{rows}x{hidden}", name, lambda: rms_norm(h, gamma, 1e-6), "F.rms_norm",
                   lambda: F.rms_norm(h, (hidden,), gamma, 1e-6))  # fmt: skip
    layer_norm = optional_op("layer_norm")
    if layer_norm is not None:
        beta = torch.randn(hidden, device=device, dtype=dtype)
        check(
            "layer_norm",
            layer_norm(h, gamma, beta, 1e-5),
            F.layer_norm(h, (hidden,), gamma, beta, 1e-5),
            1e-2,
        )
        tessel_ln = lambda: layer_norm(h, gamma, beta, 1e-5)  # noqa: E731
        torch_ln = lambda: F.layer_norm(h, (hidden,), gamma, beta, 1e-5)  # noqa: E731
        bench.pair("layer_norm", f"{rows}x{hidden}", name, tessel_ln, "F.layer_norm", torch_ln)
    silu_and_mul = optional_op("silu_and_mul")
    if silu_and_mul is not None:
        gate_up = torch.randn(rows, 2 * hidden, device=device, dtype=dtype)

        def torch_silu_mul() -> torch.Tensor:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up

        check("silu_and_mul", silu_and_mul(gate_up), torch_silu_mul(), 1e-2)
        bench.pair("silu_and_mul", f"{rows}x{2 * hidden}", name, lambda: silu_and_mul(gate_up), "F.silu(a)*b",
                   torch_silu_mul)  # fmt: skip
    softmax = optional_op("softmax")
    if softmax is not None:
        logits = torch.randn(rows, 4096, device=device, dtype=dtype)
        check("softmax", softmax(logits), torch.softmax(logits, -1), 1e-2)
        bench.pair("softmax", f"{rows}x4096", name, lambda: softmax(logits), "torch.softmax",
                   lambda: torch.softmax(logits, -1))  # fmt: skip
    flash_attention = optional_op("flash_attention")
    if flash_attention is not None:
        seq = 256 if (quick or device == "cpu") else 4096  # the CUDA target: >= 0.8x SDPA at 4096
        q = torch.randn(1, 32, seq, 128, device=device, dtype=dtype)
        k, v = (torch.randn(1, 8, seq, 128, device=device, dtype=dtype) for _ in range(2))

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

        check("flash_attention", flash_attention(q, k, v, causal=True), sdpa(), 1e-2)
        shape = f"1x32/8x{seq}x128 causal"
        bench.pair(
            "flash_attention", shape, name, lambda: flash_attention(q, k, v, causal=True), "SDPA", sdpa
        )


def print_table(results: list[Result], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("op")
    table.add_column("shape")
    table.add_column("dtype")
    table.add_column("baseline")
    for column in ("tessel ms med/min", "baseline ms med/min", "speedup med", "speedup min"):
        table.add_column(column, justify="right")
    for r in results:
        style = "green" if r.speedup_min >= 1 else "red"
        table.add_row(
            r.op, r.shape, r.dtype, r.baseline,
            f"{r.tessel_ms:.3f} / {r.tessel_min_ms:.3f}", f"{r.baseline_ms:.3f} / {r.baseline_min_ms:.3f}",
            f"{r.speedup:.2f}x", f"[{style}]{r.speedup_min:.2f}x[/{style}]",
        )  # fmt: skip
    Console(width=160).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu"
    )
    _harness.add_record_options(parser, "kernels")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's); 1 is steadier on a shared CPU",
    )
    parser.add_argument(
        "--only", choices=("gemm", "smollm2", "other"), default=None, help="run one group of ops"
    )
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    bench = Bench(args.device, args.quick)
    load_before = os.getloadavg()
    if args.only in (None, "gemm"):
        gemm_cases(bench)
    if args.only in (None, "smollm2") and args.device == "cpu":
        with torch.no_grad():
            smollm2_cases(bench)
    if args.only in (None, "other"):
        other_cases(bench)
    if args.device == "cuda":
        device_name = torch.cuda.get_device_name()
        title = f"tessel kernels on {device_name}"
    else:
        cpu = _harness.machine()["cpu"]
        device_name = cpu["name"]
        title = (
            f"tessel CPU paths on {device_name}, {torch.get_num_threads()} threads, "
            f"load {load_before[0]:.1f}; "
            f"features {', '.join(cpu['flags'])}, int8 path {cpu['int8_path']}"
        )
    print_table(bench.results, title)
    payload = {
        "device": args.device,
        "device_name": device_name,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "quick": args.quick,
        "load_average_1_5_15min_before_after": [load_before, os.getloadavg()],
        "note": "speedup = baseline / tessel (median and min of interleaved runs); > 1: tessel faster",
        "results": [asdict(r) for r in bench.results],
    }
    _harness.append_record(args.out, "kernels", payload, args.label)


if __name__ == "__main__":
    main()
