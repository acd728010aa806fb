"""Measured sensitivity (KL per layer) against the weights indicator, and the plans each one gives.

On a local checkpoint (default: SmolLM2-135M-Instruct, from `tessel example-model`):

1. per-layer costs from `tessel quantize --sensitivity` (or a file it wrote: --sensitivity FILE);
2. the weights indicator `tessel plan` uses without that file (`tessel.plan.precision.quality.weight_costs`),
   and the Spearman rank correlation of the two per precision;
3. additivity: the KL of the model with every layer at int8 (and at int4) against the sum of the
   per-layer costs the planner adds up (on the calibration windows);
4. `tessel plan --precisions fp16,int8,int4` on a bundled mixed cluster with each source (and with
   the measured costs under the same default budget plus `--theta`): which
   layers get int8 / int4, the predicted throughput, and the measured KL of each plan's precisions
   (on the calibration windows, and on as many windows of the held-out text).

    python benchmarks/sensitivity.py --threads 1
    python benchmarks/sensitivity.py --sensitivity /tmp/smollm2.json   # reuse a measured file
    python benchmarks/sensitivity.py --halves   # only: rank stability over two halves of the text

Each run appends a record to benchmarks/results/sensitivity.jsonl (`--halves`: a record of its own);
the measured costs file is left in a temporary folder (its path is printed) for `--sensitivity`.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import _harness
import numpy as np
import torch
from rich.console import Console
from rich.table import Table
from scipy.stats import spearmanr

from tessel.catalog.models import load_model
from tessel.plan.api import PlanSettings, make_plan
from tessel.plan.precision.quality import SensitivityFile, weight_costs
from tessel.quant.calibrate import calibration_windows, load_hf_model
from tessel.quant.sensitivity import SensitivityOptions, measure_kl, measure_sensitivity, write_sensitivity

ROOT = Path(__file__).resolve().parent
PRECISIONS = ("fp16", "int8", "int4")
PLAN_TIME_LIMIT_S = 20.0


def _shown(path: Path) -> str:
    """A path relative to the repository when inside it (results stay comparable across clones)."""
    path = path.resolve()
    return str(path.relative_to(ROOT.parent)) if path.is_relative_to(ROOT.parent) else str(path)


def plan_layers(
    model_dir: Path,
    cluster: str,
    sensitivity: Path | None,
    budget: float | None = None,
    theta: float | None = None,
) -> dict:
    settings = PlanSettings(
        precisions=",".join(PRECISIONS),
        sensitivity=sensitivity,
        quality_budget=budget,
        theta=theta,
        time_limit_s=PLAN_TIME_LIMIT_S,
    )
    outcome = make_plan(model_dir, cluster, "default", settings)
    names = list(outcome.result.evaluation.precisions)
    return {
        "source": outcome.instance.labels["quality_source"],
        "precisions": names,
        "int8_layers": [i for i, name in enumerate(names) if name == "int8"],
        "int4_layers": [i for i, name in enumerate(names) if name == "int4"],
        "stages": [
            f"{outcome.cluster.devices[s.device].name}: layers {s.unit_start}-{s.unit_end - 1}"
            for s in outcome.result.solution.stages
        ],
        "budget": outcome.instance.precision.quality_budget,
        "quality": outcome.result.evaluation.quality,
        "throughput_tok_s": outcome.predicted.throughput_tok_s,
    }


def split_halves(args: argparse.Namespace, console: Console) -> None:
    """Costs on the first and the second half of the calibration windows, and their rank correlation:
    a record whose result is `split_half`."""
    model, tokenizer = load_hf_model(args.model)
    windows = calibration_windows(
        args.calib.read_text(encoding="utf-8"), tokenizer, args.samples, args.seq_len
    )
    half = len(windows) // 2
    first = measure_sensitivity(model, windows[:half], ("int8", "int4"))
    second = measure_sensitivity(model, windows[half:], ("int8", "int4"))
    rank = {name: float(spearmanr(first[name], second[name]).statistic) for name in first}
    console.print(f"Spearman, costs on windows 0-{half - 1} vs {half}-{len(windows) - 1}: {rank}")
    result = {"split_half": {"first": first, "second": second, "spearman": rank}}
    _harness.append_record(args.json, "sensitivity", result, args.label)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, help="default: SmolLM2-135M-Instruct (`tessel example-model`)")
    parser.add_argument("--calib", type=Path, default=ROOT / "data" / "kjv_calibration.txt")
    parser.add_argument("--eval", type=Path, default=ROOT / "data" / "kjv_evaluation.txt")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--sensitivity", type=Path, default=None, help="reuse a measured file")
    parser.add_argument("--cluster", default="mixed-a100-v100-t4")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--theta", type=float, default=2.0, help="s per nat, for the third plan")
    parser.add_argument(
        "--halves", action="store_true", help="only: how stable the ranking is (two halves of the windows)"
    )
    _harness.add_record_options(parser, "sensitivity", flag="--json")
    args = parser.parse_args()
    args.model = _harness.example_model(args.model)
    torch.set_num_threads(args.threads)
    console = Console()
    spec = load_model(args.model)
    if args.halves:
        return split_halves(args, console)
    path, measure_s = args.sensitivity, None  # None: a file reused
    if path is None:
        path = Path(tempfile.mkdtemp(prefix="tessel-sensitivity-")) / "sensitivity_costs.json"
        with _harness.stopwatch() as elapsed:
            options = SensitivityOptions(args.calib, ("int8", "int4"), args.samples, args.seq_len)
            write_sensitivity(args.model, path, options)
        measure_s = elapsed.wall_s
        console.print(f"measured costs in {path} (reuse: --sensitivity {path})")
    measured = SensitivityFile.model_validate_json(path.read_text()).costs
    per_kind = weight_costs(spec, PRECISIONS, args.model)
    weights = per_kind["attention"] + per_kind["mlp"]  # [L, 3]

    table = Table(title=f"{spec.name}: KL per layer (nats/token) vs weights indicator")
    for column in ("layer", "KL int8", "KL int4", "weights int8", "weights int4"):
        table.add_column(column, justify="right")
    for i in range(spec.num_layers):
        table.add_row(
            str(i), f"{measured['int8'][i]:.2e}", f"{measured['int4'][i]:.2e}",
            f"{weights[i, 1]:.2e}", f"{weights[i, 2]:.2e}",
        )  # fmt: skip
    console.print(table)
    rank = {
        name: float(spearmanr(measured[name], weights[:, q]).statistic)
        for q, name in enumerate(PRECISIONS)
        if name in measured
    }
    console.print(
        "Spearman rank correlation, measured vs weights: " + str({k: round(v, 3) for k, v in rank.items()})
    )

    model, tokenizer = load_hf_model(args.model)
    calib = calibration_windows(args.calib.read_text(encoding="utf-8"), tokenizer, args.samples, args.seq_len)
    held_out = calibration_windows(
        args.eval.read_text(encoding="utf-8"), tokenizer, args.samples, args.seq_len
    )
    additivity = {}
    for name in ("int8", "int4"):
        joint = measure_kl(model, calib, [name] * spec.num_layers)
        additivity[name] = {"sum_of_layers": float(np.sum(measured[name])), "all_layers_kl": joint}
        console.print(
            f"all layers {name}: KL {joint:.4g} vs sum of per-layer costs {np.sum(measured[name]):.4g}"
        )

    plans = {}
    default_budget = 0.5 * float(np.sum(measured["int8"]))  # what `tessel plan` takes without options
    runs = (
        ("sensitivity", path, None, None),
        ("weights", None, None, None),
        (f"sensitivity, theta {args.theta:g}", path, default_budget, args.theta),
    )
    for label, source, budget, theta in runs:
        plan = plan_layers(args.model, args.cluster, source, budget, theta)
        names = [None if n == "fp16" else n for n in plan["precisions"]]
        plan["predicted_kl"] = float(sum(measured[n][i] for i, n in enumerate(names) if n is not None))
        plan["measured_kl"] = measure_kl(model, calib, names)
        plan["held_out_kl"] = measure_kl(model, held_out, names)
        plans[label] = plan
        console.print(
            f"plan with {label} costs on {args.cluster}: int8 layers {plan['int8_layers']}, "
            f"int4 layers {plan['int4_layers']}, {plan['throughput_tok_s']:.0f} tok/s predicted, "
            f"KL of its precisions {plan['measured_kl']:.4g} (sum of layer costs {plan['predicted_kl']:.4g}; "
            f"held-out text {plan['held_out_kl']:.4g})"
        )
    result = {
        "model": spec.name,
        "calibration": {"file": _shown(args.calib), "samples": args.samples, "seq_len": args.seq_len},
        "held_out": {"file": _shown(args.eval), "samples": args.samples, "seq_len": args.seq_len},
        "measure_s": measure_s,
        "costs_kl_nats_per_token": measured,
        "weights_indicator": {name: weights[:, q].tolist() for q, name in enumerate(PRECISIONS)},
        "spearman": rank,
        "additivity": additivity,
        "cluster": args.cluster,
        "plans": plans,
    }
    _harness.append_record(args.json, "sensitivity", result, args.label)


if __name__ == "__main__":
    main()
