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
- overhead: the same 2-stage plan as local processes (`tessel launch`) and over two hosts (head,
  h1), rounds alternating; output tokens/s and the ratio.
- slow link: h1's link limited to 100 Mbit/s (tc tbf); `tessel probe --ray` writes the cluster,
  `tessel plan --cluster FILE` plans SmolLM2 on it (which nodes its stages use), the plan is run over
  Ray and `tessel simulate --measured` compares its prediction with the run.
- join (a host joining under --remap auto): not implemented; reported as such.

The hosts share this machine's cores, so a host's "machine" is never faster alone; Ray's health
checks are set to 1 s x 3 on the head (`FAST_HEALTH`; Ray's default reports a dead machine after
about 14 s). Needs root, `ip` and Ray (`pip install "tessel[cluster]"`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
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
STREAM_TOKENS = 96  # long enough that every stream still runs when the host goes
DEADLINE_S = 600.0


def expected_ids(model: Path, prompts: list[str], tokens: int) -> list[list[int]]:
    from tessel import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [out.token_ids for out in LLM(model).generate(prompts, params, use_progress=False)]


def expected_texts(model: Path, prompts: list[str], tokens: int) -> list[str]:
    from tessel import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    return [out.text for out in LLM(model).generate(prompts, params, use_progress=False)]


def launch(hosts, plan: Path, model: Path, work: Path, *extra: str, ray: bool = True) -> dict:  # noqa: ANN001
    out = work / f"run-{time.monotonic_ns()}.json"
    command = [
        *TESSEL,
        "launch",
        "--plan",
        str(plan),
        "--model",
        str(model),
        "--max-tokens",
        str(EXACT_TOKENS),
    ]
    command += [arg for prompt in PROMPTS for arg in ("--prompt", prompt)]
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


def overhead(hosts, plans, model: Path, work: Path, rounds: int) -> dict:  # noqa: ANN001
    def tok_s(run: dict) -> float:
        return sum(len(r["token_ids"]) for r in run["requests"]) / run["wall_s"]

    local, remote = [], []
    for index in range(rounds):
        order = ("local", "ray") if index % 2 == 0 else ("ray", "local")
        for side in order:
            if side == "local":
                local.append(tok_s(launch(hosts, plans["2-stage-local"], model, work, ray=False)))
            else:
                remote.append(tok_s(launch(hosts, plans["2-stage-2hosts"], model, work)))
    ratios = [r / lo for r, lo in zip(remote, local, strict=True)]
    return {"local_tok_s": local, "ray_tok_s": remote, "ratio": statistics.median(ratios), "ratios": ratios}


def slow_link(hosts, model: Path, work: Path) -> dict:  # noqa: ANN001
    import yaml

    cluster, plan, run, sim = (
        work / n for n in ("ray.yaml", "slow-plan.json", "slow-run.json", "slow-sim.json")
    )
    hosts.shape("h1", mbit=100)
    try:
        hosts.run([*TESSEL, "probe", "--ray", "--out", str(cluster)], host="head", timeout=DEADLINE_S)
        hosts.run([*TESSEL, "plan", "--model", str(model), "--cluster", str(cluster), "--json", str(plan)],
                  host="head", timeout=DEADLINE_S)  # fmt: skip
        stages = [s["device"] for s in json.loads(plan.read_text())["stages"]]
        result = {"links": yaml.safe_load(cluster.read_text()).get("links"), "plan_devices": stages}
        if stages[0].split("/")[0] != "head":
            result["not_run"] = "the plan's stage 0 is not on head, where the command runs"
            return result
        command = [*TESSEL, "launch", "--executor", "ray", "--plan", str(plan), "--model", str(model)]
        command += [a for p in PROMPTS * 2 for a in ("--prompt", p)]
        command += ["--max-tokens", "32", "--ignore-eos", "--json", str(run)]
        hosts.run(command, host="head", timeout=DEADLINE_S)
        hosts.run([*TESSEL, "simulate", "--plan", str(plan), "--measured", str(run), "--json", str(sim)],
                  host="head", timeout=DEADLINE_S)  # fmt: skip
    finally:
        hosts.unshape("h1")
    result["simulate"] = json.loads(sim.read_text()).get("measured_vs_predicted")
    return result


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
            result["exact"] = exactness(hosts, plans, model, work)
            print(f"exact: {result['exact']}", flush=True)
            result["lost"] = {how: host_lost(hosts, plans["3-stage"], model, work, how, 18091 + i)
                              for i, how in enumerate(("killed", "cut off"))}  # fmt: skip
            print(f"lost: {result['lost']}", flush=True)
            result["overhead"] = overhead(hosts, plans, model, work, args.rounds)
            print(f"overhead: {result['overhead']}", flush=True)
            result["slow_link"] = slow_link(hosts, model, work)
            print(f"slow link: {result['slow_link']}", flush=True)
    result["join"] = "not implemented: a host joining is not priced under --remap auto"
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="model directory (default: SmolLM2, `tessel example-model`)")
    parser.add_argument("--rounds", type=int, default=3)
    _harness.add_record_options(parser, "ray_hosts")
    args = parser.parse_args()
    print(_harness.machine_line(), flush=True)
    result = run(args)
    lost = result["lost"]
    rows = [
        ("bring-up (s)", f"{result['bring_up_s']:.1f}"),
        ("idle RSS, 3 hosts (GiB)", f"{result['idle_rss_bytes'] / 2**30:.2f}"),
        *((f"token-exact: {k}", str(v)) for k, v in result["exact"].items()),
        *((f"lost ({how}): failed / differ / healthy s / done s / left",
           f"{r['failed']} / {r['texts_differ']} / {r['healthy_again_s']} / {r['last_stream_done_s']:.1f} / "
           f"{r['stage_processes_left_on_h1']}") for how, r in lost.items()),
        ("loaded RSS, 3-stage (GiB)", f"{lost['killed']['loaded_rss_bytes'] / 2**30:.2f}"),
        ("overhead: ray / local tok/s", f"{result['overhead']['ratio']:.3f}"),
        ("slow link: plan devices", str(result["slow_link"].get("plan_devices"))),
        ("join", result["join"]),
    ]  # fmt: skip
    for name, value in rows:
        print(f"{name:<52} {value}")
    _harness.append_record(args.out, "ray_hosts", result, args.label)


if __name__ == "__main__":
    main()
