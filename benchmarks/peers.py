"""tessel against the peers issue 12 names: llm-compressor (accuracy) and llama.cpp (CPU speed).

    python benchmarks/peers.py [--only llmc,llama] [--threads 1] [--eval-tokens N] [--out PATH.jsonl]

Runs in the benchmark venv (docs/quant.md: llm-compressor pins an older transformers and
compressed-tensors than tessel's dev install, llama-cpp-python compiles for minutes):

- llmc: llm-compressor's `oneshot` quantises SmolLM2-135M-Instruct (W8A8 round to nearest,
  SmoothQuant 0.8, SmoothQuant 0.8 + GPTQ, W8A16 per channel, W4A16 group 64 round to nearest
  and GPTQ) on tessel's calibration windows (the same `--calib-samples` x `--seq-len` tokens of
  benchmarks/data/kjv_calibration.txt that `tessel quantize` reads); each checkpoint is then
  evaluated **by tessel's engine** on the same evaluation windows as benchmarks/quant.py
  (`quant.perplexity`), beside tessel's own configurations quantised in the same process.
- llama: llama.cpp (llama-cpp-python) re-quantises the SmolLM2 GGUF (Q4_1) to Q8_0 with its own
  `llama_model_quantize` (allow_requantize); decode tok/s of one stream (64-token prompt, 128 new,
  the first excluded) and of 32 requests of 64 + 64, against tessel's W8A8 engine measured with
  `quant.decode_speed` in this process on the same threads. llama-cpp-python's `Llama` holds one
  sequence: its 32 requests run one after another (its server serialises them the same way).
  Beside them, the machine's memory read bandwidth on the same threads (`read_gbps`) and each
  one-stream row's share of the tok/s it allows at that engine's weight bytes per token
  (`bandwidth_bound`).

Each run appends a record to benchmarks/results/peers.jsonl with the sections it ran (each with its
arguments) and the machine's features.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import _harness
import torch

import quant as tessel_bench  # benchmarks/quant.py: perplexity, decode_speed, configs

W4_GROUP = 64  # SmolLM2's hidden 576 is not a multiple of llm-compressor's default 128
TESSEL_CONFIGS = ("w8a8 rtn", "w8a8 sq0.8", "w8a8 sq-auto", "w8a16", "w4a16 g64")
LLMC_CONFIGS = ("w8a8 rtn", "w8a8 sq0.8", "w8a8 sq0.8 gptq", "w8a16", "w4a16 g64", "w4a16 g64 gptq")
SMOOTHING = 0.8
LLAMA_FTYPE_MOSTLY_Q8_0 = 7  # llama.h enum llama_ftype


def _recipe(name: str) -> list:
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    ignore = ["lm_head"]
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"}
    if name.startswith("w4a16"):
        weights = {
            "num_bits": 4,
            "type": "int",
            "symmetric": True,
            "strategy": "group",
            "group_size": W4_GROUP,
        }
    groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
    if name.startswith("w8a8"):
        quantizer = {"targets": "Linear", "scheme": "W8A8", "ignore": ignore}
    else:
        quantizer = {"config_groups": groups, "ignore": ignore}
    recipe = [SmoothQuantModifier(smoothing_strength=SMOOTHING)] if "sq" in name else []
    recipe.append(GPTQModifier(**quantizer) if "gptq" in name else QuantizationModifier(**quantizer))
    return recipe


def llmc_quantize(model: Path, name: str, workdir: Path, calib_samples: int, seq_len: int) -> dict:
    """llm-compressor's oneshot on tessel's calibration windows -> a compressed-tensors checkpoint."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from transformers import AutoTokenizer

    from tessel.quant.calibrate import calibration_windows, read_calibration_text

    out = workdir / ("llmc_" + name.replace(" ", "_"))
    info = {"path": str(out)}
    if (out / "config.json").exists():
        return info
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    windows = calibration_windows(
        read_calibration_text(tessel_bench.CALIB), tokenizer, calib_samples, seq_len
    ).tolist()
    data = Dataset.from_dict({"input_ids": windows, "attention_mask": [[1] * seq_len] * len(windows)})
    with _harness.stopwatch() as elapsed:
        oneshot(
            model=str(model),
            dataset=data,
            recipe=_recipe(name),
            output_dir=str(out),
            num_calibration_samples=calib_samples,
            max_seq_length=seq_len,
            shuffle_calibration_samples=False,
        )
    info["seconds"] = elapsed.wall_s
    print(f"  llm-compressor {name}: quantised in {info['seconds']:.1f} s", flush=True)
    return info


def llmc_section(model: Path, workdir: Path, args) -> dict:
    import compressed_tensors
    import llmcompressor

    fp32 = tessel_bench.perplexity(model, args.seq_len, args.eval_tokens)
    print(f"  fp32 ppl {fp32['ppl']:.3f} over {fp32['tokens']} tokens", flush=True)
    rows: dict[str, dict] = {}
    for name in TESSEL_CONFIGS:
        path = tessel_bench._quantize(model, name, workdir, args.calib_samples, args.seq_len)
        rows[f"tessel {name}"] = tessel_bench.perplexity(path, args.seq_len, args.eval_tokens)
    for name in LLMC_CONFIGS:
        info = llmc_quantize(model, name, workdir, args.calib_samples, args.seq_len)
        row = tessel_bench.perplexity(Path(info["path"]), args.seq_len, args.eval_tokens)
        row["quantize_seconds"] = info.get("seconds")
        row["quantization_config"] = json.loads((Path(info["path"]) / "config.json").read_text())[
            "quantization_config"
        ]
        rows[f"llm-compressor {name}"] = row
    for name, row in rows.items():
        row["delta_pct"] = 100 * (row["ppl"] / fp32["ppl"] - 1)
        print(f"  {name}: ppl {row['ppl']:.3f} ({row['delta_pct']:+.2f}%)", flush=True)
    print("\n| quantised by | configuration | perplexity (tessel engine) | vs fp32 |\n|---|---|---|---|")
    print(f"| | fp32 | {fp32['ppl']:.3f} | |")
    for name, row in rows.items():
        who, config = name.split(" ", 1)
        print(f"| {who} | {config} | {row['ppl']:.3f} | {row['delta_pct']:+.2f}% |")
    return {
        "fp32": fp32,
        "rows": rows,
        "llmcompressor": llmcompressor.__version__,
        "compressed_tensors": compressed_tensors.__version__,
        "calibration": {
            "samples": args.calib_samples,
            "seq_len": args.seq_len,
            "text": str(tessel_bench.CALIB),
        },
    }


def llama_q8_0(gguf: Path, workdir: Path) -> Path:
    """The GGUF re-quantised to Q8_0 by llama.cpp's own quantiser."""
    import llama_cpp

    out = workdir / (gguf.stem.split(".")[0] + ".Q8_0.gguf")
    if out.exists():
        return out
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    params.nthread = 1
    failed = llama_cpp.llama_model_quantize(str(gguf).encode(), str(out).encode(), params)
    if failed:
        raise RuntimeError(f"llama_model_quantize returned {failed}")
    return out


def _llama_generate(llm, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """Greedy decode of `new_tokens` after `prompt`: (time of the first token, time of the last)."""
    llm.reset()
    first = last = 0.0
    for i, _token in enumerate(llm.generate(prompt, temp=0.0, reset=True)):
        last = time.perf_counter()
        if i == 0:
            first = last
        if i + 1 == new_tokens:
            break
    return first, last


def llama_speed(gguf: Path, prompts: list[list[int]], threads: int, new_single: int, new_batch: int) -> dict:
    import llama_cpp

    n_ctx = max(len(p) for p in prompts) + max(new_single, new_batch) + 8
    llm = llama_cpp.Llama(
        str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=128, verbose=False
    )
    _llama_generate(llm, prompts[0][:16], 4)  # warm-up
    first, last = _llama_generate(llm, prompts[0], new_single)
    single = {"tok_per_s": (new_single - 1) / (last - first)}
    with _harness.stopwatch() as elapsed:
        for prompt in prompts:  # one Llama holds one sequence: requests run one after another
            _llama_generate(llm, prompt, new_batch)
    total = new_batch * len(prompts)
    wall = elapsed.wall_s
    batch = {"tok_per_s": total / wall, "wall_s": wall, "cpu_s": elapsed.cpu_s, "mode": "sequential"}
    return {"single": single, "concurrent": batch, "llama_cpp_python": llama_cpp.__version__}


def llama_perplexity(gguf: Path, ids: list[int], seq_len: int, threads: int) -> dict:
    """exp(mean NLL) of llama.cpp's logits over the windows `quant.perplexity` evaluates."""
    import llama_cpp

    llm = llama_cpp.Llama(
        str(gguf), n_ctx=seq_len, n_batch=seq_len, n_threads=threads, n_threads_batch=threads,
        logits_all=True, verbose=False,
    )  # fmt: skip
    nll, count = 0.0, 0
    for first in range(0, len(ids) - 1, seq_len):
        window = ids[first : first + seq_len]
        if len(window) < 2:
            break
        llm.reset()
        llm.eval(window)
        logits = torch.from_numpy(llm.scores[: len(window) - 1].copy()).double()
        targets = torch.tensor(window[1:])
        nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        count += len(window) - 1
    return {"ppl": math.exp(nll / count), "tokens": count}


def read_gbps(threads: int) -> float:
    """This machine's memory read bandwidth on `threads` threads, GB/s (`measure_read_gbs`: the best
    of 7 sums of a 1 GiB float32 buffer, far larger than any cache), the ceiling of a decode that
    streams weights."""
    from tessel.profiling.device_bench import measure_read_gbs

    torch.set_num_threads(threads)
    return measure_read_gbs("cpu")


def weight_bytes_per_token(model: Path, head_bytes: float, body_bytes: float = 1.0) -> float:
    """Bytes of weights one decode step of one sequence reads: every decoder linear at `body_bytes`
    per weight and the LM head at `head_bytes` (the embedding: one row, left out)."""
    config = json.loads((model / "config.json").read_text())
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv = (
        config["num_attention_heads"],
        config.get("num_key_value_heads", config["num_attention_heads"]),
    )
    head_dim = config.get("head_dim", h // heads)
    attention = h * head_dim * (2 * heads + 2 * kv)  # q, o and k, v
    return layers * (attention + 3 * h * inter) * body_bytes + config["vocab_size"] * h * head_bytes


def bandwidth_bound(model: Path, gguf: Path, rows: dict, gbps: float) -> dict:
    """Each one-stream row's weight bytes per token, the tok/s the read bandwidth allows at those
    bytes, and the share of it reached. llama.cpp's Q8_0: the file's bytes (34 per 32 weights, the
    tied embedding read whole as the output layer); tessel's W8A8: int8 linears, the head int8 or
    float32."""
    per_token = {"llama.cpp Q8_0": float(gguf.stat().st_size)}
    for name in rows:
        if name.startswith("tessel"):
            per_token[name] = weight_bytes_per_token(model, 1.0 if "int8 head" in name else 4.0)
    found = {}
    for name, row in rows.items():
        bound = gbps * 1e9 / per_token[name]
        reached = row["single"]["tok_per_s"]
        found[name] = {"bytes_per_token": per_token[name], "bound_tok_per_s": bound, "share": reached / bound}
    return {"read_gbps": gbps, "rows": found}


def llama_section(model: Path, workdir: Path, args) -> dict:
    from transformers import AutoTokenizer

    gguf = llama_q8_0(_harness.example_gguf(), workdir)
    text = tessel_bench.EVAL.read_text(encoding="utf-8")
    ids = AutoTokenizer.from_pretrained(str(model))(text)["input_ids"]  # the GGUF's vocabulary, same ids
    prompts = [ids[i * 64 : (i + 1) * 64] for i in range(args.concurrent)]  # decode_speed's prompts
    ppl = llama_perplexity(gguf, ids[: args.eval_tokens], args.seq_len, args.threads)
    print(f"  llama.cpp Q8_0: ppl {ppl['ppl']:.3f} over {ppl['tokens']} tokens (its own logits)", flush=True)
    rows = {
        "llama.cpp Q8_0": llama_speed(gguf, prompts, args.threads, args.new_tokens, args.batch_new_tokens)
    }
    max_len = 64 + max(args.new_tokens, args.batch_new_tokens) + 8
    configs = [  # (row, quantisation config, lm_head, CPU path forced, enforce_eager)
        ("tessel W8A8", "w8a8 rtn", "float", None, False),
        ("tessel W8A8 + int8 head", "w8a8 rtn", "int8", None, False),
        ("tessel W8A8 + int8 head, eager decode", "w8a8 rtn", "int8", None, True),
        # the one row by inductor's float32 GEMV instead of tessel's int8 GEMV (before issue 47's kernel)
        ("tessel W8A8 + int8 head, inductor GEMV", "w8a8 rtn", "int8", {"TESSEL_INT8_GEMV": "off"}, False),
    ]
    from tessel.kernels import cpu_features

    if cpu_features.choose_int8_path() == "fp16codes":  # AVX2: fbgemm, 7-bit weight codes or activations
        configs.append(("tessel W8A8 7-bit weight codes + int8 head", "w8a8 w7 rtn", "int8", None, False))
        fbgemm = {"TESSEL_INT8_PATH": "fbgemm"}
        configs.append(("tessel W8A8 fbgemm + int8 head", "w8a8 rtn", "int8", fbgemm, False))
    for name, config, lm_head, forced, eager in configs:
        checkpoint = tessel_bench._quantize(model, config, workdir, args.calib_samples, args.seq_len)
        llm = tessel_bench._speed_llm(checkpoint, forced, lm_head, eager, max_len)
        rows[name] = {
            "single": tessel_bench.decode_speed(llm, 1, 64, args.new_tokens),
            "concurrent": tessel_bench.decode_speed(llm, args.concurrent, 64, args.batch_new_tokens),
        }
        del llm
    base = rows["llama.cpp Q8_0"]
    n = args.concurrent
    print(f"\n| engine | decode tok/s, 1 stream | vs llama.cpp | tok/s, {n} requests | vs llama.cpp |")
    print("|---|---|---|---|---|")
    for name, row in rows.items():
        s1, sb = row["single"]["tok_per_s"], row["concurrent"]["tok_per_s"]
        print(f"| {name} | {s1:.1f} | {s1 / base['single']['tok_per_s']:.2f}x | {sb:.1f} | "
              f"{sb / base['concurrent']['tok_per_s']:.2f}x |")  # fmt: skip
    bound = bandwidth_bound(model, gguf, rows, read_gbps(args.threads))
    print(f"\nmemory read bandwidth, {args.threads} thread(s): {bound['read_gbps']:.1f} GB/s")
    print("| engine, one stream | weight MB / token | bound tok/s | tok/s | share of the bound |")
    print("|---|---|---|---|---|")
    for name, row in bound["rows"].items():
        print(f"| {name} | {row['bytes_per_token'] / 1e6:.1f} | {row['bound_tok_per_s']:.1f} | "
              f"{rows[name]['single']['tok_per_s']:.1f} | {row['share']:.1%} |")  # fmt: skip
    return {
        "gguf": str(gguf), "gguf_bytes": gguf.stat().st_size, "perplexity": ppl, "rows": rows,
        "bandwidth_bound": bound,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", help="HF model directory (default: SmolLM2-135M-Instruct from the cache)")
    parser.add_argument("--only", default="llmc,llama", help="comma list of llmc, llama")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=512, help="evaluation and calibration window")
    parser.add_argument("--eval-tokens", type=int, default=8192, help="evaluate the first N tokens")
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128, help="single-stream decode tokens")
    parser.add_argument("--batch-new-tokens", type=int, default=64, help="per request")
    parser.add_argument("--concurrent", type=int, default=32)
    parser.add_argument("--workdir", help="keep quantised checkpoints here (default: a temp dir)")
    _harness.add_record_options(parser, "peers")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    only = set(args.only.split(","))
    print(_harness.machine_line())
    result: dict = {"torch": torch.__version__}
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="tessel-peers-"))
    workdir.mkdir(parents=True, exist_ok=True)
    model = tessel_bench._model_dir(args.model)
    try:
        if "llmc" in only:
            result["llm_compressor"] = dict(llmc_section(model, workdir, args), args=vars(args))
        if "llama" in only:
            result["llama_cpp"] = dict(llama_section(model, workdir, args), args=vars(args))
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    _harness.append_record(args.out, "peers", result, args.label)


if __name__ == "__main__":
    main()
