"""Serving across machines on emulated hosts (issue 44's targets, one run): three Linux network
namespaces on a bridge, each its own `ray start` (`tests/emulated_hosts.py`), SmolLM2-135M on CPUs.

    sudo python benchmarks/ray_hosts.py [--model DIR] [--rounds 3] [--out PATH.jsonl]

- bring-up: seconds from nothing to three hosts registered in Ray; memory (RSS of every process in
  the hosts' namespaces) idle and while a 3-stage pipeline is loaded.
- exact: token ids of `tessel launch --executor ray` of a 2- and a 3-stage plan over the hosts, a
  flow plan whose two paths cross hosts, and `tessel serve --executor ray` of a replica plan whose
  replicas run on different hosts, each against one process (`LLM(model).generate`, greedy).
- lost: 8 streams through `tessel serve --executor ray` of a 3-stage plan (head, h1, h2), then h2
  lost (its raylet and every process killed; then, h2 restarted, its link set down instead):
  failed streams, streams whose text differs from one process's, seconds from the loss until the
  server answers /health 200 again and until the last stream ends, stage processes of the old
  pipeline left on h1.
- overhead: the same 2-stage plan as local processes (`tessel launch`, 8 prompts, 64 tokens each)
  and over two hosts (head, h1), rounds alternating; output tokens/s over stage 0's generate, the
  ratio, and the CPU seconds Ray's own processes (raylets, GCS, idle workers) used in each Ray run.
- slow link: `tessel profile` of this CPU on head (the catalog's CPU figures are peaks); h1's link
  limited to 100 Mbit/s (tc tbf); `tessel probe --ray` writes the cluster (its links recorded), `tessel
  plan --cluster ray --profile` plans SmolLM2 on it (which nodes its stages use), the plan is run over
  Ray and `tessel simulate --measured` compares its prediction with the run.
- join: h2 leaves, SmolLM2 is planned on head and h1 (`plan --cluster ray`) and served with `--remap
  auto`; h2 joins while requests run: the decision on the grown cluster, the seconds from the join
  until the grown pipeline serves, requests that failed or answered otherwise than one process.

The hosts share this machine's cores, so a host's "machine" is never faster alone; Ray's health
checks are set to 1 s x 3 on the head (`FAST_HEALTH`; Ray's default reports a dead machine after
about 14 s). Needs root, `ip` and Ray (`pip install "tessel[cluster]"`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import _harness

TESSEL = [sys.executable, "-m", "tessel.cli"]
PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "Once upon a time", "One two three"]
EXACT_TOKENS = 16
OVERHEAD_TOKENS = 64
STREAM_TOKENS = 96  # long enough that every stream still runs when the host goes
DEADLINE_S = 600.0
PARTS = ("exact", "lost", "overhead", "slow_link", "join")


def expected_ids(model: Path, prompts: list[str], tokens: int) -> list[list[int]]:
    from tessel import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [out.token_ids for out in LLM(model).generate(prompts, params, use_progress=False)]


def expected_texts(model: Path, prompts: list[str], tokens: int) -> list[str]:
    from tessel import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [out.text for out in LLM(model).generate(prompts, params, use_progress=False)]


def launch(  # noqa: PLR0913
    hosts,  # noqa: ANN001
    plan: Path,
    model: Path,
    work: Path,
    *extra: str,
    ray: bool = True,
    prompts: list[str] = PROMPTS,  # noqa: B006 - never changed
    tokens: int = EXACT_TOKENS,
) -> dict:
    out = work / f"run-{time.monotonic_ns()}.json"
    command = [*TESSEL, "launch", "--plan", str(plan), "--model", str(model), "--max-tokens", str(tokens)]
    command += [arg for prompt in prompts for arg in ("--prompt", prompt)]
    command += ["--ignore-eos", "--json", str(out), *(["--executor", "ray"] if ray else []), *extra]
    hosts.run(command, host="head", timeout=DEADLINE_S)
    return json.loads(out.read_text())


def namespace_rss_bytes(hosts) -> int:  # noqa: ANN001
    total = 0
    for name in hosts.names:
        for pid in hosts.pids(name):
            with contextlib.suppress(OSError):
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
    return total


def exactness(hosts, plans, model: Path, work: Path) -> dict:  # noqa: ANN001
    expected = expected_ids(model, PROMPTS, EXACT_TOKENS)
    found = {}
    for name in ("2-stage", "3-stage", "flow"):
        run = launch(hosts, plans[name], model, work, "--max-num-seqs", "2")
        found[name] = [r["token_ids"] for r in run["requests"]] == expected
    prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS]
    texts = expected_texts(model, prompts, EXACT_TOKENS)
    serve = [*TESSEL, "serve", "--model", str(model), "--plan", str(plans["replicas"])]
    with hosts.serving(serve, 18090, work / "replicas.log", DEADLINE_S) as client:

        def complete(prompt: str) -> tuple[str, str]:
            body = {"prompt": prompt, "max_tokens": EXACT_TOKENS, "temperature": 0, "ignore_eos": True}
            answer = client.post("/v1/completions", json=body)
            return answer.json()["choices"][0]["text"], answer.headers.get("x-tessel-replica", "?")

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(complete, prompts))
    found["replicas"] = [t for t, _ in answers] == texts
    found["replicas_answering"] = sorted({r for _, r in answers})
    return found


def _stream(client, prompt: str, started: threading.Semaphore) -> str:  # noqa: ANN001
    body = {
        "prompt": prompt,
        "max_tokens": STREAM_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    texts = []
    with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}")
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                texts.append(json.loads(line[6:])["choices"][0]["text"])
                if len(texts) == 4:
                    started.release()
    return "".join(texts)


def host_lost(hosts, plan: Path, model: Path, work: Path, how: str, port: int) -> dict:  # noqa: ANN001
    prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS]
    expected = expected_texts(model, prompts, STREAM_TOKENS)
    serve = [*TESSEL, "serve", "--model", str(model), "--plan", str(plan), "--heartbeat-timeout", "10"]
    with hosts.serving(serve, port, work / f"lost-{how}.log", DEADLINE_S) as client:
        before_h1 = set(hosts.pids("h1"))
        loaded_rss = namespace_rss_bytes(hosts)
        started = threading.Semaphore(0)
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            streams = [pool.submit(_stream, client, prompt, started) for prompt in prompts]
            for _ in prompts:
                started.acquire(timeout=DEADLINE_S)
            lost_at = time.monotonic()
            (hosts.kill_raylet if how == "killed" else hosts.cut)("h2")
            healthy_s = seen_down = None  # /health answers 503 from the loss noticed until rebuilt
            while healthy_s is None and time.monotonic() - lost_at < DEADLINE_S:
                time.sleep(0.5)
                with contextlib.suppress(Exception):
                    code = client.get("/health", timeout=5).status_code
                    seen_down = seen_down or code != 200
                    healthy_s = time.monotonic() - lost_at if seen_down and code == 200 else None
            outcomes = []
            for future in streams:
                try:
                    outcomes.append(future.result(timeout=DEADLINE_S))
                except Exception as error:  # noqa: BLE001 - counted as a failed request
                    outcomes.append(error)
            done_s = time.monotonic() - lost_at
        left = [
            pid
            for pid in set(hosts.pids("h1")) & before_h1
            if b"tessel.pipeline.stage.worker" in _cmdline(pid)
        ]
    failed = sum(isinstance(o, Exception) for o in outcomes)
    differ = sum(
        1 for o, e in zip(outcomes, expected, strict=True) if not isinstance(o, Exception) and o != e
    )
    hosts.restart("h2")
    return {
        "streams": len(prompts), "failed": failed, "texts_differ": differ, "healthy_again_s": healthy_s,
        "last_stream_done_s": done_s, "stage_processes_left_on_h1": len(left), "loaded_rss_bytes": loaded_rss,
    }  # fmt: skip


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def cpu_seconds(hosts) -> dict[int, tuple[str, float]]:  # noqa: ANN001
    """Each process of the emulated hosts: its name and the CPU seconds it has used."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for name in hosts.names:
        for pid in hosts.pids(name):
            with contextlib.suppress(OSError, ValueError, IndexError):
                stat = Path(f"/proc/{pid}/stat").read_text()
                fields = stat[stat.rindex(")") + 2 :].split()
                found[pid] = (
                    stat[stat.index("(") + 1 : stat.rindex(")")],
                    (int(fields[11]) + int(fields[12])) / ticks,
                )
    return found


def ray_daemons_cpu(before: dict, after: dict) -> dict[str, float]:
    """CPU seconds by process name, over the processes alive at both snapshots (Ray's daemons and
    idle workers: a run's stage processes come and go inside it)."""
    used: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        if pid in before and before[pid][0] == name:
            used[name] = used.get(name, 0.0) + seconds - before[pid][1]
    return {name: round(s, 2) for name, s in sorted(used.items(), key=lambda kv: -kv[1]) if s > 0.005}


def overhead(hosts, plans, model: Path, work: Path, rounds: int) -> dict:  # noqa: ANN001
    def tok_s(run: dict) -> float:
        return sum(len(r["token_ids"]) for r in run["requests"]) / run["wall_s"]

    # long enough that a run's first steps (each process's first forward) weigh little
    load = {"prompts": [f"{p} {i}" for i in range(2) for p in PROMPTS], "tokens": OVERHEAD_TOKENS}
    local, remote, daemons, waits = [], [], [], {"local": [], "ray": []}
    for index in range(rounds):
        order = ("local", "ray") if index % 2 == 0 else ("ray", "local")
        for side in order:
            if side == "local":
                run = launch(hosts, plans["2-stage-local"], model, work, ray=False, **load)
                local.append(tok_s(run))
            else:
                before, started = cpu_seconds(hosts), time.monotonic()
                run = launch(hosts, plans["2-stage-2hosts"], model, work, **load)
                used = ray_daemons_cpu(before, cpu_seconds(hosts))
                daemons.append({"wall_s": round(time.monotonic() - started, 2), "run_wall_s": run["wall_s"],
                                "cpu_s_by_process": used})  # fmt: skip
                remote.append(tok_s(run))
            # per stage: seconds of its compute spent off the CPU (waiting for a core)
            waits[side].append([round(st["compute_s"] - st["compute_cpu_s"], 2) for st in run["stages"]])
    ratios = [r / lo for r, lo in zip(remote, local, strict=True)]
    return {
        "local_tok_s": local, "ray_tok_s": remote, "ratio": statistics.median(ratios), "ratios": ratios,
        "ray_daemons": daemons, "compute_off_cpu_s": waits,
    }  # fmt: skip


def slow_link(hosts, model: Path, work: Path) -> dict:  # noqa: ANN001
    import yaml

    cluster, plan, run, sim, profile = (
        work / n for n in ("ray.yaml", "slow-plan.json", "slow-run.json", "slow-sim.json", "cpu-profile.json")
    )
    # Priced by a profile measured on head: the catalog's CPU peaks are 10-40x this CPU's speed.
    hosts.run([*TESSEL, "profile", "--device", "cpu", "--model", str(model), "--budget-s", "60",
               "--json", str(profile)], host="head", timeout=DEADLINE_S)  # fmt: skip
    priced = ["--profile", str(profile)]
    hosts.shape("h1", mbit=100)
    try:
        hosts.run([*TESSEL, "probe", "--ray", "--out", str(cluster)], host="head", timeout=DEADLINE_S)
        # --cluster ray probes again and keeps stage 0 on this machine (a file leaves it to the solver)
        planning = ["plan", "--model", str(model), "--cluster", "ray", *priced, "--json", str(plan)]
        hosts.run([*TESSEL, *planning], host="head", timeout=DEADLINE_S)
        stages = [s["device"] for s in json.loads(plan.read_text())["stages"]]
        result = {"links": yaml.safe_load(cluster.read_text()).get("links"), "plan_devices": stages}
        if stages[0].split("/")[0] != "head":
            result["not_run"] = "the plan's stage 0 is not on head, where the command runs"
            return result
        command = [*TESSEL, "launch", "--executor", "ray", "--plan", str(plan), "--model", str(model)]
        command += [a for p in PROMPTS * 2 for a in ("--prompt", p)]
        command += ["--max-tokens", "32", "--ignore-eos", "--json", str(run)]
        hosts.run(command, host="head", timeout=DEADLINE_S)
        simulating = ["simulate", "--plan", str(plan), *priced, "--measured", str(run), "--json", str(sim)]
        hosts.run([*TESSEL, *simulating], host="head", timeout=DEADLINE_S)
    finally:
        hosts.unshape("h1")
    result["predicted_vs_measured"] = json.loads(sim.read_text())["measured"]["comparison"]
    return result


def host_joins(hosts, model: Path, work: Path) -> dict:  # noqa: ANN001
    """h2 leaves; SmolLM2 planned on head and h1 (`plan --cluster ray`) and served with --remap auto;
    h2 joins while requests run: the decision on the grown cluster, the seconds from the join until
    the new pipeline serves, and the requests that failed or answered otherwise than one process."""
    hosts.leave("h2")
    plan, log = work / "join-plan.json", work / "join.log"
    hosts.run([*TESSEL, "plan", "--model", str(model), "--cluster", "ray", "--json", str(plan)],
              host="head", timeout=DEADLINE_S)  # fmt: skip
    before = [s["device"] for s in json.loads(plan.read_text())["stages"]]
    texts = dict(zip(PROMPTS, expected_texts(model, PROMPTS, 8), strict=True))
    serve = [*TESSEL, "serve", "--model", str(model), "--plan", str(plan), "--remap", "auto"]
    serve += ["--remap-interval-s", "1"]
    answered, wrong, stop = [], [], threading.Event()
    with hosts.serving(serve, 18095, log, DEADLINE_S) as client:

        def load() -> None:
            index = 0
            while not stop.is_set():
                prompt = PROMPTS[index % len(PROMPTS)]
                body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                try:
                    answer = client.post("/v1/completions", json=body)
                    ok = answer.status_code == 200 and answer.json()["choices"][0]["text"] == texts[prompt]
                except Exception:  # noqa: BLE001 - counted
                    ok = False
                (answered if ok else wrong).append(index)
                index += 1

        worker = threading.Thread(target=load, daemon=True)
        worker.start()
        hosts.join("h2")
        joined_at = time.monotonic()
        remapped_s = None
        while time.monotonic() - joined_at < DEADLINE_S / 2:
            text = log.read_text()
            if "remapped (" in text:
                remapped_s = time.monotonic() - joined_at
                break
            if "joined the cluster" in text and "remap decision" in text and "remap (" not in text:
                decided = [line for line in text.splitlines() if "joined the cluster" in line]
                if decided and "kept" in decided[-1]:
                    break
            time.sleep(0.5)
        time.sleep(5.0)  # requests on whichever pipeline serves now
        stop.set()
        worker.join(DEADLINE_S)
    decisions = [line.strip() for line in log.read_text().splitlines() if "joined the cluster" in line]
    return {
        "plan_before": before, "decision": decisions[-1] if decisions else None,
        "join_to_serving_s": remapped_s, "requests": len(answered) + len(wrong),
        "failed_or_differ": len(wrong),
    }  # fmt: skip


def write_plans(pipeline_plans, model: Path, work: Path) -> dict[str, Path]:  # noqa: ANN001
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    half, third = layers // 2, layers // 3
    wp = pipeline_plans.write_plan
    plans = {
        "2-stage": wp(work / "p2.json", model, [(0, half), (half, layers)], devices=["head/cpu0", "h2/cpu0"]),
        "3-stage": wp(work / "p3.json", model, [(0, third), (third, 2 * third), (2 * third, layers)],
                      devices=["head/cpu0", "h1/cpu0", "h2/cpu0"]),
        "2-stage-2hosts": wp(work / "p2h.json", model, [(0, half), (half, layers)],
                             devices=["head/cpu0", "h1/cpu0"]),
        "2-stage-local": wp(work / "p2l.json", model, [(0, half), (half, layers)]),
    }  # fmt: skip
    placements = {"head/cpu0": (0, half), "h1/cpu0": (half, layers), "h2/cpu0": (half, layers)}
    paths = [(["head/cpu0", "h1/cpu0"], 0.5, 1), (["head/cpu0", "h2/cpu0"], 0.5, 1)]
    plans["flow"] = pipeline_plans.write_flow_plan(work / "flow.json", model, placements, paths)
    replicas = json.loads(plans["2-stage-2hosts"].read_text())
    solo = {**replicas["stages"][1], "index": 0, "device": "h2/cpu0", "layer_start": 0, "unit_start": 0}
    replicas.update(version=2, replicas=[
        {"index": 0, "weight": 0.5, "stages": replicas["stages"]},
        {"index": 1, "weight": 0.5, "stages": [solo], "micro_batches": 1},
    ])  # fmt: skip
    plans["replicas"] = work / "replicas.json"
    plans["replicas"].write_text(json.dumps(replicas))
    return plans


def run(args: argparse.Namespace) -> dict:
    emulated_hosts = _harness.tests_module("emulated_hosts")
    pipeline_plans = _harness.tests_module("pipeline_plans")
    why = emulated_hosts.available()
    if why is not None:
        raise SystemExit(f"emulated hosts cannot be made here: {why}")
    model = _harness.example_model(args.model)
    result: dict = {"model": str(model)}
    with tempfile.TemporaryDirectory(prefix="ray-hosts-") as folder:
        work = Path(folder)
        plans = write_plans(pipeline_plans, model, work)
        started = time.monotonic()
        with emulated_hosts.EmulatedHosts(["head", "h1", "h2"]) as hosts:
            result["bring_up_s"] = time.monotonic() - started
            result["idle_rss_bytes"] = namespace_rss_bytes(hosts)
            print(
                f"up in {result['bring_up_s']:.1f} s, {result['idle_rss_bytes'] / 2**30:.2f} GiB", flush=True
            )
            parts = {
                "exact": lambda: exactness(hosts, plans, model, work),
                "lost": lambda: {how: host_lost(hosts, plans["3-stage"], model, work, how, 18091 + i)
                                 for i, how in enumerate(("killed", "cut off"))},
                "overhead": lambda: overhead(hosts, plans, model, work, args.rounds),
                "slow_link": lambda: slow_link(hosts, model, work),
                "join": lambda: host_joins(hosts, model, work),
            }  # fmt: skip
            for name in args.parts:
                result[name] = parts[name]()
                print(f"{name}: {result[name]}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory (default: SmolLM2, `tessel example-model`)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS, help="what to measure")
    _harness.add_record_options(parser, "ray_hosts")
    args = parser.parse_args()
    print(_harness.machine_line(), flush=True)
    result = run(args)
    for name, value in summary_rows(result):
        print(f"{name:<56} {value}")
    _harness.append_record(args.out, "ray_hosts", result, args.label)


def summary_rows(result: dict) -> list[tuple[str, str]]:
    rows = [("bring-up (s)", f"{result['bring_up_s']:.1f}"),
            ("idle RSS, 3 hosts (GiB)", f"{result['idle_rss_bytes'] / 2**30:.2f}")]  # fmt: skip
    rows += [(f"token-exact: {k}", str(v)) for k, v in result.get("exact", {}).items()]
    for how, r in result.get("lost", {}).items():
        rows.append((f"lost ({how}): failed / differ / healthy again s / done s / left",
                     f"{r['failed']} / {r['texts_differ']} / {r['healthy_again_s']:.1f} / "
                     f"{r['last_stream_done_s']:.1f} / {r['stage_processes_left_on_h1']}"))  # fmt: skip
        rows.append(
            (f"lost ({how}): RSS with the 3-stage plan loaded (GiB)", f"{r['loaded_rss_bytes'] / 2**30:.2f}")
        )
    if "overhead" in result:
        rows.append(("overhead: ray / local tok/s", f"{result['overhead']['ratio']:.3f}"))
        for index, run in enumerate(result["overhead"].get("ray_daemons", [])):
            top = ", ".join(f"{name} {s:.1f}" for name, s in list(run["cpu_s_by_process"].items())[:4])
            rows.append((f"overhead: Ray daemons' CPU s, run {index} ({run['wall_s']:.0f} s)", top))
        for side, runs in result["overhead"].get("compute_off_cpu_s", {}).items():
            rows.append((f"overhead: {side} stages' compute off CPU (s)", str(runs)))
    if "slow_link" in result:
        rows.append(("slow link: plan devices", str(result["slow_link"].get("plan_devices"))))
        for row in result["slow_link"].get("predicted_vs_measured", []):
            figures = f"{row['predicted']:.4g} / {row['measured']:.4g} ({row['error']:+.0%})"
            rows.append((f"slow link: {row['label']} predicted / measured (error)", figures))
    if "join" in result:
        join = result["join"]
        figures = f"{join['join_to_serving_s']} / {join['requests']} / {join['failed_or_differ']}"
        rows.append(("join: s to the grown pipeline / requests / failed", figures))
    return rows


if __name__ == "__main__":
    main()
