"""Pipeline runtime against the simulator: predicted vs measured TTFT, TPOT and throughput.

    python benchmarks/pipeline.py [--quick] [--model DIR] [--out benchmarks/results/pipeline.jsonl]
    python benchmarks/pipeline.py --clusters 2-stage --variants plan --no-cpp   # one row

1. Profiles this CPU (`tessel profile --device cpu` on the model's layer shape, fp32, 1 thread).
2. Plans the model (`tessel plan --solver dp --dtype fp32 --profile ...`) on four local-CPU clusters:
   2 and 3 stages, each with and without an emulated half-speed device (`emulate: {speed: 0.5}`).
3. Runs the plan and its uniform baseline on the same closed batch of requests (token-id prompts of
   a fixed length, `ignore_eos`), one process per stage (`tessel.pipeline.run.run_pipeline`), and
   simulates the same batch with the same scheduler settings (pinned slots = micro-batches in flight,
   token budget) on the plan's priced pipeline (`tessel.sim`, with the profile).
4. CPP on vs off for one long prompt on the 2-stage plan: measured TTFT (whole prompt as one
   micro-batch vs the chunk planner's cut) next to the chunk planner's predicted TTFTs.

Prints a table and appends a record to benchmarks/results/pipeline.jsonl. Every stage runs 1 torch
thread; the simulator shares a host's cores among its stages (processor sharing, `tessel.sim`).
Other programs' load is not in the prediction: each stage reports the CPU seconds of its compute
(`compute_cpu_s`, process time) beside its wall seconds (`compute_s`), so the per-stage table
compares the priced compute with CPU time (load-free) and the row's "replay" re-simulates it with
each stage's measured CPU availability (CPU / wall of its compute): when the replay matches and
the prediction does not, the gap is the machine's load, not the model (the record has the load
average before and after). A loaded host lends its cores unevenly over a run, so each stage also
counts its batches with prompt tokens apart and a second replay runs it at its prefill availability
until its last prefill, then at its decode one (`replayed_by_phase`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import _harness
from rich.console import Console
from rich.table import Table

FULL = {"requests": 8, "prompt": 256, "output": 64, "cpp_prompt": 4096, "profile_budget_s": 120, "slots": 4}
QUICK = {"requests": 2, "prompt": 32, "output": 4, "cpp_prompt": 1024, "profile_budget_s": 15, "slots": 2}
LINK = {"bandwidth_gbps": 80, "latency_us": 50}  # local-cpu.yaml's assumption for gloo over loopback
CLUSTERS = {
    "2-stage": [("localhost", 2, None)],
    "2-stage-slow": [("localhost", 1, None), ("localhost-slow", 1, 0.5)],
    "3-stage": [("localhost", 3, None)],
    "3-stage-slow": [("localhost", 2, None), ("localhost-slow", 1, 0.5)],
}


def tessel(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "tessel.cli", *args], check=True, stdout=subprocess.DEVNULL)


def write_cluster(path: Path, name: str, nodes: list) -> Path:
    lines = [f"name: {name}", "nodes:"]
    for node, count, speed in nodes:
        lines += [f"  - name: {node}", f"    gpus: {{type: cpu, count: {count}}}"]
        lines += [
            f"    intra_link: {{bandwidth_gbps: {LINK['bandwidth_gbps']}, latency_us: {LINK['latency_us']}}}"
        ]
        if speed is not None:
            lines.append(f"    emulate: {{speed: {speed}}}")
    lines.append(f"network: {{bandwidth_gbps: {LINK['bandwidth_gbps']}, latency_us: {LINK['latency_us']}}}")
    path.write_text("\n".join(lines) + "\n")
    return path


def write_workload(path: Path, cfg: dict) -> Path:
    path.write_text(
        "name: bench\n"
        f"prompt_tokens: {{mean: {cfg['prompt']}, max: {cfg['prompt']}}}\n"
        f"output_tokens: {{mean: {cfg['output']}, max: {cfg['output']}}}\n"
        f"batch_size: {cfg['requests']}\n"
        f"max_micro_batch: {cfg['slots']}\n"
    )
    return path


def variant_plan(plan_path: Path, variant: str, out: Path) -> Path | None:
    """A plan file whose main stages are `variant`'s (the plan itself or a feasible baseline)."""
    data = json.loads(plan_path.read_text())
    if variant != "plan":
        baseline = data.get("baselines", {}).get(variant) or {}
        if not baseline.get("feasible") or not baseline.get("stages"):
            return None
        data["stages"], data["predicted"] = baseline["stages"], baseline.get("predicted")
    out.write_text(json.dumps(data))
    return out


def prompts_file(path: Path, n: int, tokens: int, vocab: int, seed: int) -> Path:
    rng = random.Random(seed)
    lines = [json.dumps({"prompt": [rng.randrange(100, vocab) for _ in range(tokens)]}) for _ in range(n)]
    path.write_text("\n".join(lines) + "\n")
    return path


def measure(plan: Path, model: Path, requests: Path, cfg: dict, **overrides) -> dict:
    from tessel.pipeline.run import RunOptions, run_pipeline

    options = RunOptions(
        plan,
        model,
        prompts_file=requests,
        max_tokens=overrides.pop("max_tokens", cfg["output"]),
        ignore_eos=True,
        max_num_seqs=256,
        max_model_len=cfg["max_model_len"],
        kv_cache_gib=0.25,
        micro_batches=cfg["slots"],
        warmup=True,
        **overrides,
    )
    run = run_pipeline(options)
    from tessel.commands.launch import add_stage_utilization

    add_stage_utilization(run.stages, options)  # each stage's measured MFU and MBU, as `tessel launch`
    ttft = [r["ttft_s"] for r in run.requests]
    tpot = [r["tpot_s"] for r in run.requests if r["tpot_s"] is not None]
    tokens = sum(r["num_output_tokens"] for r in run.requests)
    return {
        "ttft_s": sum(ttft) / len(ttft),
        "tpot_s": sum(tpot) / len(tpot) if tpot else None,
        "throughput_tok_s": tokens / run.wall_s,
        "wall_s": run.wall_s,
        "stages": run.stages,
        "stage_utilization": [status.get("utilization") for status in run.stages],
        # CPU seconds over wall seconds of the stages' compute: under 1 where a stage waited for a core
        # (other stages of this run on the same cores, or other programs' load)
        "compute_cpu_over_wall": sum(s.get("compute_cpu_s", 0.0) for s in run.stages)
        / max(sum(s.get("compute_s", 0.0) for s in run.stages), 1e-9),
    }


def predict(
    plan: Path,
    profiles: list[Path],
    cfg: dict,
    prompt: int,
    output: int,
    n: int,
    cpp: bool,
    availability: list[float] | None = None,
    phases: list[tuple[float, float]] | None = None,
) -> dict:
    """The simulator's prediction; with `availability` (per stage, the measured CPU seconds per wall
    second of its compute), a replay instead: each stage's priced time on a core of its own divided by
    its availability, no core sharing modelled (the measured availability holds it, and the load).
    With `phases` (per stage, the availability of its batches with prompt tokens and of the others) the
    replay runs twice: a stage runs at its prefill availability until its last prefill batch of the first
    run ends, then at its decode one (a closed batch: every prompt is prefilled first)."""
    from tessel.cost.profile import load_profile
    from tessel.plan.files.plan_file import load_plan
    from tessel.sim import SimConfig, SimSchedulerConfig, compute_metrics, simulate
    from tessel.sim.cpp import cpp_chunk_sizer
    from tessel.sim.plan_pipeline import pipeline_for
    from tessel.sim.requests import Request
    from tessel.sim.scheduler import MicroBatch
    from tessel.sim.simulator import batch_compute_time_s
    from tessel.sim.utilization import stage_utilization

    plan_file = load_plan(plan)
    priced = pipeline_for(plan_file, profiles=[load_profile(p) for p in profiles])
    chunk_sizes = cpp_chunk_sizer(priced.pipeline) if cpp else None
    scheduler = SimSchedulerConfig(
        max_num_seqs=256,
        max_num_batched_tokens=max(2048, prompt) if not cpp else 2048,
        pipelined_prefill=cpp,
        chunk_sizes=chunk_sizes,
    )
    shares = [getattr(stage, "core_share", 1.0) for stage in priced.pipeline.stages]  # static, priced in
    fractions = [min(1.0, stage.emulate_speed) for stage in plan_file.main.stages]  # the rest is asleep
    slowdowns = ()
    if phases is not None:
        availability = [a for a, _ in phases]
        first = predict(plan, profiles, cfg, prompt, output, n, cpp, availability)
        slowdowns = tuple(
            ((0.0, 1.0 / (a * x)), (end, 1.0 / (d * x)))
            for (a, d), x, end in zip(phases, shares, first["prefill_phase_s"], strict=True)
        )
    elif availability is not None:
        slowdowns = tuple(((0.0, 1.0 / (a * x)),) for a, x in zip(availability, shares, strict=True))
    config = SimConfig(
        scheduler,
        max_in_flight=cfg["slots"],
        pinned=cfg["slots"] > 1,
        logits_time_s=priced.logits_time_s,
        cores=priced.cores
        if availability is None and phases is None
        else None,  # a host's stages share its cores
        slowdowns=slowdowns,
    )
    result = simulate(priced.pipeline, [Request(i, 0.0, prompt, output) for i in range(n)], config)
    metrics = compute_metrics(result)
    tpot = metrics.tpot_s.mean
    utilizations = stage_utilization(plan_file, plan_file.main.stages, result, metrics.stage_busy_s)
    cpu = [0.0] * priced.pipeline.n_stages  # each stage's compute on a core of its own, asleep excluded
    for interval in result.intervals:
        if interval.kind == "compute":
            i = interval.stage
            last = i == priced.pipeline.n_stages - 1
            batch = MicroBatch(interval.batch_id, interval.items, interval.group)
            time = batch_compute_time_s(priced.pipeline.stages[i], batch, config.mix,
                                        config.logits_time_s if last else None)  # fmt: skip
            cpu[i] += time / shares[i] * fractions[i]
    return {
        "ttft_s": metrics.ttft_s.mean,
        "prefill_phase_s": prefill_phase_s(result, priced.pipeline.n_stages),
        "tpot_s": None if tpot != tpot else tpot,
        "throughput_tok_s": metrics.throughput_tok_s,
        "stage_utilization": [u.to_json() for u in utilizations],  # predicted MFU and MBU per stage
        "stage_busy_s": list(metrics.stage_busy_s),  # per stage: its batches' compute time
        "stage_cpu_s": cpu,  # per stage: the CPU seconds of that compute
    }


def prefill_phase_s(result, n_stages: int) -> list[float]:  # noqa: ANN001 (SimResult)
    """Per stage, from its first batch's start to the end of its last batch with prompt tokens."""
    first = [None] * n_stages
    end = [0.0] * n_stages
    for interval in result.intervals:
        if interval.kind != "compute":
            continue
        i = interval.stage
        first[i] = interval.start_s if first[i] is None else min(first[i], interval.start_s)
        if any(item.kind == "prefill" for item in interval.items):
            end[i] = max(end[i], interval.end_s)
    return [max(e - (f or 0.0), 0.0) for e, f in zip(end, first, strict=True)]


def rel_error(predicted: float | None, measured: float | None) -> float | None:
    if predicted is None or measured is None or measured == 0:
        return None
    return (predicted - measured) / measured


def run(model: Path, cfg: dict, work: Path, console: Console, only: dict | None = None) -> dict:
    """Every cluster and variant, then CPP; `only` ({"clusters", "variants", "cpp"}) narrows the run."""
    only = only or {}
    from tessel.models.config import ModelConfig

    config = ModelConfig.from_dir(model)
    cfg = {**cfg, "max_model_len": max(cfg["cpp_prompt"], cfg["prompt"] + cfg["output"]) + 8}
    profile = work / "profile.json"
    console.print(f"profiling the CPU on {model.name}'s layer ({cfg['profile_budget_s']} s budget) ...")
    tessel(
        "profile", "--device", "cpu", "--model", str(model), "--scale", "1", "--dtype", "float32",
        "--budget-s", str(cfg["profile_budget_s"]), "--max-offset", str(cfg["cpp_prompt"]),
        "--json", str(profile),
    )  # fmt: skip
    # the host's profile also prices its emulated copies (times divided by the speed)
    profiles = [profile]
    profile_args = ["--profile", str(profile)]
    contention, alone = without_contention(profile, work / "profile-without-contention.json")
    workload = write_workload(work / "workload.yaml", cfg)
    requests = prompts_file(work / "requests.jsonl", cfg["requests"], cfg["prompt"], config.vocab_size, 0)
    rows = []
    for name, nodes in CLUSTERS.items():
        if only.get("clusters") and name not in only["clusters"]:
            continue
        cluster = write_cluster(work / f"{name}.yaml", f"local-cpu-{name}", nodes)
        plan = work / f"{name}.json"
        console.print(f"planning {name} ...")
        tessel(
            "plan", "--model", str(model), "--cluster", str(cluster), "--workload", str(workload),
            "--solver", "dp", "--dtype", "fp32", "--kv-dtype", "fp32", *profile_args, "--json", str(plan),
        )  # fmt: skip
        for variant in only.get("variants") or ("plan", "uniform"):
            path = variant_plan(plan, variant, work / f"{name}-{variant}.json")
            if path is None:
                continue
            stages = [(s["layer_start"], s["layer_end"]) for s in json.loads(path.read_text())["stages"]]
            console.print(f"running {name} {variant} {stages} ...")
            measured = measure(path, model, requests, cfg)
            args = (path, profiles, cfg, cfg["prompt"], cfg["output"], cfg["requests"])
            predicted = predict(*args, cpp=False)
            # the same prediction with the stages' memory contention left out (the profile's
            # `contention:decode`), to show what it adds
            unshared = predict(path, [alone], *args[2:], cpp=False)
            availability = [cpu_availability(s) for s in measured["stages"]]
            replayed = predict(*args, cpp=False, availability=availability)
            phases = [phase_availability(s) for s in measured["stages"]]
            by_phase = predict(*args, cpp=False, phases=phases)
            rows.append({"cluster": name, "variant": variant, "layers": stages, "measured": measured,
                         "predicted": predicted, "predicted_without_contention": unshared,
                         "replayed": replayed, "replayed_by_phase": by_phase,
                         "availability": availability, "availability_by_phase": phases})  # fmt: skip
    cpp = cpp_rows(model, cfg, work, profiles, config.vocab_size, console) if only.get("cpp", True) else None
    found = {"config": cfg, "rows": rows, "cpp": cpp, "speedups": speedups(rows)}
    return found | {"contention_decode": contention}


def without_contention(profile: Path, out: Path) -> tuple[float | None, Path]:
    """(the profile's decode slowdown per co-runner, c1 of `contention:decode`, None without one; a
    copy of the profile without it)."""
    data = json.loads(profile.read_text())
    fit = data.get("components", {}).pop("contention:decode", None)
    out.write_text(json.dumps(data))
    return (None if fit is None else fit["c1"]), out


def cpu_availability(stage: dict) -> float:
    """CPU seconds per wall second of a stage's compute (1: it never waited for a core)."""
    wall = stage.get("compute_s") or 0.0
    return min(1.0, stage.get("compute_cpu_s", wall) / wall) if wall > 0 else 1.0


def phase_availability(stage: dict) -> tuple[float, float]:
    """(prefill, decode): `cpu_availability` over the stage's batches with prompt tokens and the rest."""
    pre_wall, pre_cpu = stage.get("prefill_compute_s") or 0.0, stage.get("prefill_compute_cpu_s") or 0.0
    rest = {"compute_s": stage.get("compute_s", 0.0) - pre_wall,
            "compute_cpu_s": stage.get("compute_cpu_s", 0.0) - pre_cpu}  # fmt: skip
    prefill = {"compute_s": pre_wall, "compute_cpu_s": pre_cpu}
    return cpu_availability(prefill), cpu_availability(rest)


def cpp_rows(model: Path, cfg: dict, work: Path, profiles: list[Path], vocab: int, console: Console) -> dict:
    from tessel.chunk.schedule import evaluate_chunks
    from tessel.cost.profile import load_profile
    from tessel.pipeline.chunk_cutter import ChunkCutter
    from tessel.plan.files.plan_file import load_plan
    from tessel.sim.plan_pipeline import pipeline_for

    plan = work / "2-stage-plan.json"
    n = cfg["cpp_prompt"]
    one = prompts_file(work / "long.jsonl", 1, n, vocab, 1)
    priced = pipeline_for(load_plan(plan), profiles=[load_profile(p) for p in profiles])
    chunks = ChunkCutter(priced.pipeline).chunks(n)
    tail = priced.logits_time_s(1)
    predicted_on = evaluate_chunks(priced.pipeline, chunks, [n], tail).ttft_s
    predicted_off = evaluate_chunks(priced.pipeline, [n], [n], tail).ttft_s
    console.print(f"CPP: {n}-token prompt, chunks {chunks} ...")
    common = {
        "max_tokens": 1,
        "max_num_batched_tokens": n,
        "profiles": profiles,
    }  # the runtime cuts as predicted
    on = measure(plan, model, one, cfg, cpp=True, **common)
    off = measure(plan, model, one, cfg, cpp=False, **common)
    return {
        "prompt_tokens": n,
        "chunks": chunks,
        "measured_ttft_s": {"on": on["ttft_s"], "off": off["ttft_s"]},
        "predicted_ttft_s": {"on": predicted_on, "off": predicted_off},
        "measured_chunks": on["stages"][0].get("cpp_chunks"),
        "measured_gain": off["ttft_s"] / on["ttft_s"],
        "predicted_gain": predicted_off / predicted_on,
    }


def speedups(rows: list[dict]) -> list[dict]:
    out = []
    for cluster in CLUSTERS:
        by = {r["variant"]: r for r in rows if r["cluster"] == cluster}
        if "plan" in by and "uniform" in by:
            m = by["plan"]["measured"]["throughput_tok_s"] / by["uniform"]["measured"]["throughput_tok_s"]
            p = by["plan"]["predicted"]["throughput_tok_s"] / by["uniform"]["predicted"]["throughput_tok_s"]
            row = {"cluster": cluster, "measured": m, "predicted": p, "rel_error": rel_error(p, m)}
            if "replayed" in by["plan"] and "replayed" in by["uniform"]:
                r = by["plan"]["replayed"]["throughput_tok_s"] / by["uniform"]["replayed"]["throughput_tok_s"]
                row.update(replayed=r, replayed_rel_error=rel_error(r, m))
            out.append(row)
    return out


def _mfu_cells(predicted: list | None, measured: list | None) -> str:
    """Each stage's decode-inclusive MFU, predicted (simulator) / measured (`tessel launch`'s rule)."""
    if not predicted or not measured:
        return "-"

    def pct(u):  # noqa: ANN001
        return "-" if u is None else f"{u['mfu'] * 100:.1f}"

    return " ".join(f"{pct(a)}/{pct(b)}" for a, b in zip(predicted, measured, strict=False))


def stage_table(rows: list[dict]) -> Table:
    """Per stage: the simulator's busy time next to the measured one, as wall time (compute +
    emulation sleep) and as the process's CPU time over the same spans; CPU well under wall means
    the stage waited for a core (time-sharing with the other stages or other load)."""
    table = Table(title="per stage: busy s predicted / measured wall (compute + sleep), CPU s in compute, "
                  "process CPU s while serving, wall s of the run")  # fmt: skip
    for column in ("cluster", "split", "stage", "pred busy", "meas busy", "compute wall", "pred CPU",
                   "compute CPU", "process CPU", "run wall"):  # fmt: skip
        table.add_column(column, justify="right")

    def s(v):
        return "-" if v is None else f"{v:.2f}"

    for r in rows:
        busy = r["predicted"].get("stage_busy_s") or []
        cpu = r["predicted"].get("stage_cpu_s") or []
        for i, stage in enumerate(r["measured"]["stages"]):
            table.add_row(
                r["cluster"], r["variant"], str(i), s(busy[i] if i < len(busy) else None),
                s(stage.get("compute_s", 0.0) + stage.get("emulation_sleep_s", 0.0)),
                s(stage.get("compute_s")), s(cpu[i] if i < len(cpu) else None),
                s(stage.get("compute_cpu_s")), s(stage.get("process_cpu_s")), s(r["measured"]["wall_s"]),
            )  # fmt: skip
    return table


def _replay_cell(replayed: dict | None, measured: dict) -> str:
    """The replay's errors (the prediction with each stage's measured CPU availability)."""
    if not replayed:
        return "-"
    errors = (rel_error(replayed[k], measured[k]) for k in ("ttft_s", "tpot_s", "throughput_tok_s"))
    return " ".join("-" if e is None else f"{e * 100:+.0f}%" for e in errors)


def render(result: dict, console: Console) -> None:
    table = Table(title="pipeline runtime: simulator prediction vs measured (means over requests)")
    for column in ("cluster", "split", "layers", "TTFT ms pred/meas", "TPOT ms pred/meas", "tok/s pred/meas",
                   "err TTFT", "err TPOT", "err tok/s", "replay err TTFT/TPOT/tok/s | by phase",
                   "CPU/wall per stage",
                   "MFU % per stage pred/meas"):  # fmt: skip
        table.add_column(column, justify="right")

    def ms(v):
        return "-" if v is None else f"{v * 1e3:.1f}"

    def pct(v):
        return "-" if v is None else f"{v * 100:+.0f}%"

    for r in result["rows"]:
        p, m = r["predicted"], r["measured"]
        table.add_row(
            r["cluster"], r["variant"], " ".join(f"{a}-{b - 1}" for a, b in r["layers"]),
            f"{ms(p['ttft_s'])} / {ms(m['ttft_s'])}", f"{ms(p['tpot_s'])} / {ms(m['tpot_s'])}",
            f"{p['throughput_tok_s']:.1f} / {m['throughput_tok_s']:.1f}",
            pct(rel_error(p["ttft_s"], m["ttft_s"])), pct(rel_error(p["tpot_s"], m["tpot_s"])),
            pct(rel_error(p["throughput_tok_s"], m["throughput_tok_s"])),
            _replay_cell(r.get("replayed"), m) + " | " + _replay_cell(r.get("replayed_by_phase"), m),
            " ".join(f"{a:.2f}" for a in r.get("availability") or []) or "-",
            _mfu_cells(p.get("stage_utilization"), m.get("stage_utilization")),
        )  # fmt: skip
    console.print(table)
    contention = result.get("contention_decode")
    if contention is not None:
        console.print(f"the profile's decode slowdown beside another stage: {1 + contention:.3f}x; without:")
    for r in result["rows"]:
        alone, m = r.get("predicted_without_contention"), r["measured"]
        if contention is not None and alone is not None:
            keys = ("ttft_s", "tpot_s", "throughput_tok_s")
            errors = " / ".join(pct(rel_error(alone[k], m[k])) for k in keys)
            console.print(f"  {r['cluster']} {r['variant']}: TTFT / TPOT / tok/s errors {errors}")
    console.print(stage_table(result["rows"]))
    speed = Table(title="planned split over uniform split (throughput)")
    for column in ("cluster", "predicted", "measured", "rel. error", "replayed", "replay error"):
        speed.add_column(column, justify="right")
    for s in result["speedups"]:
        replayed = f"{s['replayed']:.2f}x" if "replayed" in s else "-"
        speed.add_row(s["cluster"], f"{s['predicted']:.2f}x", f"{s['measured']:.2f}x", pct(s["rel_error"]),
                      replayed, pct(s.get("replayed_rel_error")))  # fmt: skip
    console.print(speed)
    c = result["cpp"]
    if c is None:
        return
    console.print(
        f"CPP, {c['prompt_tokens']}-token prompt on 2 stages, chunks {c['chunks']}: TTFT off/on measured "
        f"{ms(c['measured_ttft_s']['off'])}/{ms(c['measured_ttft_s']['on'])} ms "
        f"(gain {c['measured_gain']:.2f}x), "
        f"predicted {ms(c['predicted_ttft_s']['off'])}/{ms(c['predicted_ttft_s']['on'])} ms "
        f"(gain {c['predicted_gain']:.2f}x)",
        highlight=False,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke test, not a measurement")
    parser.add_argument("--model", type=Path, help="HF model directory (default: SmolLM2-135M-Instruct)")
    _harness.add_record_options(parser, "pipeline")
    _harness.add_size_options(parser, FULL)
    parser.add_argument("--clusters", help=f"only these clusters, comma-separated ({', '.join(CLUSTERS)})")
    parser.add_argument("--variants", help="only these splits, comma-separated (plan, uniform)")
    parser.add_argument("--no-cpp", action="store_true", help="leave out the CPP on/off rows")
    args = parser.parse_args()
    cfg = _harness.sizes(args, QUICK if args.quick else FULL)
    args.model = _harness.example_model(args.model)
    console = Console(highlight=False, width=200)
    console.print(_harness.machine_line())
    load_before = os.getloadavg()
    with _harness.stopwatch() as elapsed, tempfile.TemporaryDirectory(prefix="tessel-pipeline-bench-") as tmp:
        only = {
            "clusters": args.clusters and args.clusters.split(","),
            "variants": args.variants and args.variants.split(","),
            "cpp": not args.no_cpp,
        }
        result = run(args.model, cfg, Path(tmp), console, only)
    result.update(
        model=str(args.model),
        quick=args.quick,
        wall_s=elapsed.wall_s,
        loadavg_before=load_before,
        loadavg_after=os.getloadavg(),
    )
    render(result, console)
    _harness.append_record(args.out, "pipeline", result, args.label)


if __name__ == "__main__":
    main()
