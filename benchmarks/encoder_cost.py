"""The cost model's encoder FLOPs against a measured CPU: tessel's BERT encoder timed beside a plain
GEMM in the same run, so the ratio says how much of this CPU's GEMM rate an encoder forward gets.

    python benchmarks/encoder_cost.py [--model all-minilm-l6-v2] [--batch 16] [--tokens 128]

The model is the shape of a preset or HF directory (`tessel.catalog.models.load_model`, an encoder)
run by the engine's own `tessel.models.bert.BertEncoder` with random weights (the time does not
depend on the values). Timed interleaved (`_harness.time_calls`): one forward of `--batch`
sequences of `--tokens` tokens, and the n x n fp32 GEMM `tessel probe` measures. Reported: the
model's FLOPs (`encoder_forward_flops`), the GEMM rate, the forward's rate, their ratio (the
forward's FLOP/s as a fraction of the GEMM's), and the roofline's prediction for the forward on the
catalog's `cpu` (what the planner assumes) against the measured forward. Prints the CPU (ISA) and
appends a record to benchmarks/results/encoder_cost.jsonl. The machine may be shared: only the
ratio of two timings of one run is meant to be compared.
"""

from __future__ import annotations

import argparse

import _harness


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="all-minilm-l6-v2", help="encoder preset or HF directory")
    parser.add_argument("--batch", type=int, default=16, help="sequences per forward")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per sequence")
    parser.add_argument("--gemm-size", type=int, default=1024, help="n of the reference n x n GEMM")
    parser.add_argument("--repeats", type=int, default=5)
    _harness.add_record_options(parser, "encoder_cost")
    args = parser.parse_args()

    import torch

    from tessel.catalog.bert_config import BertConfig
    from tessel.catalog.gpus import get_gpu
    from tessel.catalog.models import PRESETS, load_model
    from tessel.cost import layer as L
    from tessel.cost.roofline import embed_time_s, unit_prefill_time_s
    from tessel.models.bert import BertEncoder
    from tessel.profiling.device_bench import gemm_flops

    model = load_model(args.model)
    if not model.encoder:
        raise SystemExit(f"{args.model} is not an encoder")
    key = args.model.strip().lower()
    fields = PRESETS[key][1] if key in PRESETS else None
    bert = BertConfig.from_dict(fields) if fields is not None else BertConfig.from_dir(args.model)
    torch.manual_seed(0)
    encoder = BertEncoder(bert).eval()
    ids = torch.randint(0, bert.vocab_size, (args.batch, args.tokens))
    mask = torch.ones_like(ids)
    n = args.gemm_size
    a, b = torch.randn(n, n), torch.randn(n, n)

    def forward() -> None:
        with torch.inference_mode():
            encoder(ids, mask)

    print(_harness.machine_line())
    timings = _harness.time_calls(
        {"forward": forward, "gemm": lambda: torch.matmul(a, b)}, repeats=args.repeats
    )
    forward_s, gemm_s = timings["forward"].median_s, timings["gemm"].median_s
    flops = args.batch * L.encoder_forward_flops(model, args.tokens)
    cpu = get_gpu("cpu")
    predicted_s = model.num_layers * unit_prefill_time_s(
        model, cpu, "layer", args.tokens, 0, batch_size=args.batch, dtype="fp32"
    ) + embed_time_s(model, cpu, args.batch * args.tokens, "fp32")
    result = {
        "model": model.name,
        "batch": args.batch,
        "tokens": args.tokens,
        "threads": torch.get_num_threads(),
        "forward_flops": flops,
        "forward_median_s": forward_s,
        "forward_tflops": flops / forward_s / 1e12,
        "gemm_size": n,
        "gemm_median_s": gemm_s,
        "gemm_tflops": gemm_flops(n) / gemm_s / 1e12,
        "forward_rate_of_gemm_rate": (flops / forward_s) / (gemm_flops(n) / gemm_s),
        "roofline_catalog_cpu_s": predicted_s,
        "measured_over_roofline": forward_s / predicted_s,
    }
    print(
        f"{model.name}: {args.batch} x {args.tokens} tokens, {flops / 1e9:.2f} GFLOP per forward; "
        f"forward {forward_s * 1e3:.1f} ms ({result['forward_tflops'] * 1e3:.1f} GFLOP/s), GEMM {n}^3 "
        f"{result['gemm_tflops'] * 1e3:.1f} GFLOP/s: the forward runs at "
        f"{result['forward_rate_of_gemm_rate']:.2f} of the GEMM rate; the roofline on the catalog's cpu "
        f"predicts {predicted_s * 1e3:.1f} ms ({result['measured_over_roofline']:.1f}x faster than measured)"
    )
    _harness.append_record(args.out, "encoder_cost", result, args.label)


if __name__ == "__main__":
    main()
