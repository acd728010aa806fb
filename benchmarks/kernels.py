"""Time tessel's kernels against the PyTorch ops they replace; print a table, write JSON.

    python benchmarks/kernels.py [--quick] [--device cpu|cuda] [--out benchmarks/results/kernels.json]

On CUDA every op is timed with `triton.testing.do_bench` (median of a 25 ms warm-up + 100 ms of
runs) against its torch baseline: fp16 matmul, torch._int_mm, SDPA, F.rms_norm, F.conv2d, ...
On CPU the CPU paths are timed against their float baselines with a median wall-clock timer;
the headline is `Int8Linear` (per-token quantisation + torch._int_mm + fused epilogue) against
fp32 `nn.Linear` at 256 x 4096 x 4096 (target: >= 2x). Attention/norm ops from other modules
are imported lazily and skipped when absent. `speedup` = baseline time / tessel time.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

RESULTS = Path(__file__).parent / "results" / "kernels.json"


@dataclass(slots=True)
class Result:
    op: str
    shape: str
    dtype: str
    tessel_ms: float
    baseline: str
    baseline_ms: float
    speedup: float  # baseline_ms / tessel_ms: > 1 means tessel is faster


def cpu_median_ms(fn: Callable[[], object], repeats: int, min_time_s: float = 0.0) -> float:
    """Median wall time of `fn` after two warm-up calls; keeps sampling until min_time_s has passed."""
    fn()
    fn()
    samples: list[float] = []
    start = time.perf_counter()
    while len(samples) < repeats or time.perf_counter() - start < min_time_s:
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
        if len(samples) >= 20 * repeats:
            break
    return statistics.median(samples)


def cuda_ms(fn: Callable[[], object], quick: bool) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10 if quick else 25, rep=40 if quick else 100, return_mode="median")


def timer(device: str, quick: bool) -> Callable[[Callable[[], object]], float]:
    if device == "cuda":
        return lambda fn: cuda_ms(fn, quick)
    return lambda fn: cpu_median_ms(fn, repeats=5 if quick else 15)


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


def gemm_cases(device: str, quick: bool, measure) -> list[Result]:
    from tessel.kernels import int8_gemm, quantize_per_token, w8a16_gemm
    from tessel.kernels.w8a16_gemm import linear
    from tessel.layers import Int8Linear, W8A16Linear

    results = []
    float_dtype = torch.float16 if device == "cuda" else torch.float32
    shapes = [(256, 4096, 4096)] if quick else [(1, 4096, 4096), (16, 4096, 4096), (256, 4096, 4096),
                                                 (256, 11008, 4096), (2048, 4096, 4096)]  # fmt: skip
    if device == "cpu" and not quick:
        shapes = [(16, 4096, 4096), (256, 4096, 4096), (256, 11008, 4096)]
    for m, n, k in shapes:
        shape = f"{m}x{n}x{k}"
        x = torch.randn(m, k, device=device, dtype=float_dtype)
        ref_linear = torch.nn.Linear(k, n, device=device, dtype=float_dtype)
        weight, bias = ref_linear.weight.detach(), ref_linear.bias.detach()
        with torch.no_grad():
            expected = ref_linear(x)
            base_ms = measure(lambda: F.linear(x, weight, bias))
            base_name = f"F.linear {str(float_dtype).removeprefix('torch.')}"

            int8_layer = Int8Linear.from_linear(ref_linear)
            check("Int8Linear", int8_layer(x), expected, 0.05)
            ms = measure(lambda: int8_layer(x))
            results.append(Result("Int8Linear (W8A8)", shape, "int8", ms, base_name, base_ms, base_ms / ms))

            q, s = quantize_per_token(x)
            w_q, w_s, b32 = int8_layer.weight, int8_layer.weight_scale, int8_layer.bias
            ms = measure(lambda: quantize_per_token(x))
            results.append(Result("quantize_per_token", f"{m}x{k}", "->int8", ms, base_name, base_ms, base_ms / ms))
            ms = measure(lambda: int8_gemm(q, w_q, s, w_s, b32, out_dtype=float_dtype))
            results.append(Result("int8_gemm", shape, "int8", ms, base_name, base_ms, base_ms / ms))
            if device == "cpu" or (m > 16 and k % 8 == 0 and n % 8 == 0):
                int_mm_ms = measure(lambda: torch._int_mm(q, w_q.t()))
                results.append(
                    Result("int8_gemm", shape, "int8", ms, "torch._int_mm (no scales)", int_mm_ms, int_mm_ms / ms)
                )

            w8a16_layer = W8A16Linear.from_linear(ref_linear)
            check("W8A16Linear", w8a16_layer(x), expected, 0.05)
            ms = measure(lambda: w8a16_gemm(x, w_q, w_s, b32))
            results.append(Result("w8a16_gemm", shape, "int8 w", ms, base_name, base_ms, base_ms / ms))

            if device == "cuda":
                check("linear", linear(x, weight, bias), expected, 1e-2)
                ms = measure(lambda: linear(x, weight, bias))
                results.append(Result("linear", shape, "fp16", ms, base_name, base_ms, base_ms / ms))
        del ref_linear, int8_layer, w8a16_layer
    return results


def other_cases(device: str, quick: bool, measure) -> list[Result]:
    from tessel.kernels import conv2d, transpose

    results = []
    dtype = torch.float16 if device == "cuda" else torch.float32
    name = str(dtype).removeprefix("torch.")

    x = torch.randn(4096, 4096 if device == "cuda" else 2048, device=device, dtype=dtype)
    check("transpose", transpose(x), x.t(), 0)
    ms, base = measure(lambda: transpose(x)), measure(lambda: x.t().contiguous())
    results.append(Result("transpose", "x".join(map(str, x.shape)), name, ms, "x.t().contiguous()", base, base / ms))

    batch = 8 if device == "cuda" else 2
    img = torch.randn(batch, 64, 56, 56, device=device, dtype=dtype)
    w = torch.randn(128, 64, 3, 3, device=device, dtype=dtype) / 24
    check("conv2d", conv2d(img, w, padding=1), F.conv2d(img, w, padding=1), 1e-2)
    ms, base = measure(lambda: conv2d(img, w, padding=1)), measure(lambda: F.conv2d(img, w, padding=1))
    results.append(Result("conv2d", f"{batch}x64x56x56 * 128x64x3x3", name, ms, "F.conv2d", base, base / ms))

    hidden = 4096
    rows = 256 if quick else 2048
    h = torch.randn(rows, hidden, device=device, dtype=dtype)
    gamma = torch.rand(hidden, device=device, dtype=dtype) + 0.5
    rms_norm = optional_op("rms_norm")
    if rms_norm is not None:
        want = F.rms_norm(h, (hidden,), gamma, 1e-6)
        check("rms_norm", rms_norm(h, gamma, 1e-6), want, 1e-2)
        ms, base = measure(lambda: rms_norm(h, gamma, 1e-6)), measure(lambda: F.rms_norm(h, (hidden,), gamma, 1e-6))
        results.append(Result("rms_norm", f"{rows}x{hidden}", name, ms, "F.rms_norm", base, base / ms))
    layer_norm = optional_op("layer_norm")
    if layer_norm is not None:
        beta = torch.randn(hidden, device=device, dtype=dtype)
        check("layer_norm", layer_norm(h, gamma, beta, 1e-5), F.layer_norm(h, (hidden,), gamma, beta, 1e-5), 1e-2)
        ms = measure(lambda: layer_norm(h, gamma, beta, 1e-5))
        base = measure(lambda: F.layer_norm(h, (hidden,), gamma, beta, 1e-5))
        results.append(Result("layer_norm", f"{rows}x{hidden}", name, ms, "F.layer_norm", base, base / ms))
    silu_and_mul = optional_op("silu_and_mul")
    if silu_and_mul is not None:
        gate_up = torch.randn(rows, 2 * hidden, device=device, dtype=dtype)

        def torch_silu_mul() -> torch.Tensor:
            gate, up = gate_up.chunk(2, dim=-1)
            return F.silu(gate) * up

        check("silu_and_mul", silu_and_mul(gate_up), torch_silu_mul(), 1e-2)
        ms, base = measure(lambda: silu_and_mul(gate_up)), measure(torch_silu_mul)
        results.append(Result("silu_and_mul", f"{rows}x{2 * hidden}", name, ms, "F.silu(a)*b", base, base / ms))
    softmax = optional_op("softmax")
    if softmax is not None:
        logits = torch.randn(rows, 4096, device=device, dtype=dtype)
        check("softmax", softmax(logits), torch.softmax(logits, -1), 1e-2)
        ms, base = measure(lambda: softmax(logits)), measure(lambda: torch.softmax(logits, -1))
        results.append(Result("softmax", f"{rows}x4096", name, ms, "torch.softmax", base, base / ms))
    flash_attention = optional_op("flash_attention")
    if flash_attention is not None:
        seq = 256 if (quick or device == "cpu") else 2048
        q = torch.randn(1, 32, seq, 128, device=device, dtype=dtype)
        kv = [torch.randn(1, 8, seq, 128, device=device, dtype=dtype) for _ in range(2)]

        def sdpa() -> torch.Tensor:
            return F.scaled_dot_product_attention(q, kv[0], kv[1], is_causal=True, enable_gqa=True)

        check("flash_attention", flash_attention(q, kv[0], kv[1], causal=True), sdpa(), 1e-2)
        ms, base = measure(lambda: flash_attention(q, kv[0], kv[1], causal=True)), measure(sdpa)
        results.append(Result("flash_attention", f"1x32/8x{seq}x128 causal", name, ms, "SDPA", base, base / ms))
    return results


def print_table(results: list[Result], title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in ("op", "shape", "dtype", "tessel ms", "baseline", "baseline ms", "speedup"):
        table.add_column(column, justify="right" if "ms" in column or column == "speedup" else "left")
    for r in results:
        style = "green" if r.speedup >= 1 else "red"
        table.add_row(
            r.op, r.shape, r.dtype, f"{r.tessel_ms:.3f}", r.baseline, f"{r.baseline_ms:.3f}",
            f"[{style}]{r.speedup:.2f}x[/{style}]",
        )  # fmt: skip
    Console().print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repeats")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--only", choices=("gemm", "other"), default=None, help="run one group of ops")
    args = parser.parse_args()

    torch.manual_seed(0)
    measure = timer(args.device, args.quick)
    load_before = os.getloadavg()
    results: list[Result] = []
    if args.only in (None, "gemm"):
        results += gemm_cases(args.device, args.quick, measure)
    if args.only in (None, "other"):
        results += other_cases(args.device, args.quick, measure)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    title = f"tessel kernels on {device_name} ({torch.get_num_threads()} threads)" if args.device == "cpu" else (
        f"tessel kernels on {device_name}"
    )  # fmt: skip
    print_table(results, title)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "device": args.device,
        "device_name": device_name,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "quick": args.quick,
        "load_average_before_after": [load_before, os.getloadavg()],
        "note": "speedup = baseline_ms / tessel_ms; CPU timings are medians of wall-clock runs",
        "results": [asdict(r) for r in results],
    }
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
