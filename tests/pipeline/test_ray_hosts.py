"""A plan served across machines with Ray (issue 44), on machines emulated by network namespaces
(`tests/emulated_hosts.py`): the stages on the nodes the plan names, tokens equal one process's; a
machine lost mid-stream rebuilt on the machines left with no request lost; bad placements refused
before any stage starts. Slow: three `ray start`s and stage processes on a 2-core machine."""

from __future__ import annotations

import itertools
import json
import shutil
import sys
import threading
import time

import httpx
import pytest

from emulated_hosts import EmulatedHosts, available
from pipeline_plans import write_flow_plan, write_plan
from tessel import LLM, SamplingParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(available() is not None, reason=str(available())),
]

PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog.", "Once upon a time", "One two"]
MAX_TOKENS = 12
DEADLINE_S = 180.0  # generous: a loaded 2-core machine
TESSEL = [sys.executable, "-m", "tessel.cli"]


@pytest.fixture(scope="module")
def hosts():
    with EmulatedHosts(["head", "h1", "h2"]) as emulated:
        yield emulated


def _expected(model, prompts=PROMPTS, max_tokens=MAX_TOKENS) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.token_ids for out in LLM(model).generate(prompts, params, use_progress=False)]


def _launch(hosts, plan, model, tmp_path, *extra) -> dict:
    out = tmp_path / "out.json"
    command = [*TESSEL, "launch", "--executor", "ray", "--plan", str(plan), "--model", str(model)]
    command += [arg for prompt in PROMPTS for arg in ("--prompt", prompt)]
    command += ["--max-tokens", str(MAX_TOKENS), "--ignore-eos", "--json", str(out), *extra]
    hosts.run(command, host="head", timeout=DEADLINE_S * 2)
    return json.loads(out.read_text())


@pytest.mark.parametrize("split", [[(0, 2), (2, 5)], [(0, 2), (2, 4), (4, 5)]])
def test_launch_over_hosts_gives_one_process_tokens(hosts, tiny_dirs, tmp_path, split):
    model = tiny_dirs["tied"]
    names = ["head", "h1", "h2"][: len(split)]
    plan = write_plan(tmp_path / "plan.json", model, split, devices=[f"{n}/cpu0" for n in names])
    run = _launch(hosts, plan, model, tmp_path)
    assert [r["token_ids"] for r in run["requests"]] == _expected(model)
    assert [s["state"] for s in run["stages"]] == ["done"] * len(split)


def test_a_flow_plan_whose_paths_cross_hosts_gives_one_process_tokens(hosts, tiny_dirs, tmp_path):
    """Placements on three machines: head holds the first layers and feeds h1 and h2 (two paths)."""
    model = tiny_dirs["tied"]
    placements = {"head/cpu0": (0, 2), "h1/cpu0": (2, 5), "h2/cpu0": (2, 5)}
    paths = [(["head/cpu0", "h1/cpu0"], 0.5, 1), (["head/cpu0", "h2/cpu0"], 0.5, 1)]
    plan = write_flow_plan(tmp_path / "flow.json", model, placements, paths)
    run = _launch(hosts, plan, model, tmp_path, "--max-num-seqs", "1")
    assert [r["token_ids"] for r in run["requests"]] == _expected(model)
    assert [s["state"] for s in run["stages"]] == ["done"] * 3
    assert all(count > 0 for count in run["stages"][0]["path_requests"].values())  # both paths ran


def test_a_replica_plan_serves_each_replica_on_its_machines(hosts, tiny_dirs, tmp_path):
    """Replica 0 on head and h1, replica 1 on h2: each replica's server runs on its first machine
    (replica 1's on h2), the router here; every answer equals one process's, both replicas answer."""
    import concurrent.futures

    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 5)], devices=["head/cpu0", "h1/cpu0"])
    data = json.loads(plan.read_text())
    solo = {**data["stages"][1], "index": 0, "device": "h2/cpu0", "layer_start": 0, "unit_start": 0}
    data["version"] = 2
    data["replicas"] = [
        {"index": 0, "weight": 0.5, "stages": data["stages"]},
        {"index": 1, "weight": 0.5, "stages": [solo], "micro_batches": 1},
    ]
    plan.write_text(json.dumps(data))
    prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = [out.text for out in LLM(model).generate(prompts, params, use_progress=False)]
    serve = [*TESSEL, "serve", "--model", str(model), "--plan", str(plan)]
    with hosts.serving(serve, 18082, tmp_path / "serve.log") as client:
        on_h2 = [pid for pid in hosts.pids("h2") if b"--replica\x001\x00" in _cmdline(pid)]
        assert on_h2, "replica 1's server does not run on h2"

        def complete(prompt: str) -> tuple[str, str]:
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"], response.headers["x-tessel-replica"]

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(complete, prompts))
    assert [text for text, _ in answers] == expected
    assert {replica for _, replica in answers} == {"0", "1"}


def test_a_plan_naming_a_missing_node_is_refused_naming_it(hosts, tiny_dirs, tmp_path):
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 5)], devices=["head/cpu0", "h9/cpu0"])
    command = [*TESSEL, "launch", "--executor", "ray", "--plan", str(plan), "--model", str(model)]
    done = hosts.run([*command, "--prompt", "hi"], host="head", timeout=DEADLINE_S, check=False)
    assert done.returncode == 2, done.stderr
    message = " ".join(done.stderr.split())
    assert "'h9'" in message and all(name in message for name in ("head", "h1", "h2"))


def test_stage_0_runs_where_the_command_runs(hosts, tiny_dirs, tmp_path):
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 5)], devices=["h1/cpu0", "h2/cpu0"])
    command = [*TESSEL, "launch", "--executor", "ray", "--plan", str(plan), "--model", str(model)]
    done = hosts.run([*command, "--prompt", "hi"], host="head", timeout=DEADLINE_S, check=False)
    assert done.returncode == 2 and "run the command on h1" in " ".join(done.stderr.split()), done.stderr


def test_an_unreachable_ray_address_is_an_error_within_its_bound(hosts, tiny_dirs, tmp_path):
    model = tiny_dirs["tied"]
    plan = write_plan(tmp_path / "plan.json", model, [(0, 2), (2, 5)], devices=["head/cpu0", "h1/cpu0"])
    command = [*TESSEL, "launch", "--executor", "ray", "--ray-address", "10.213.0.99:6379"]
    command += ["--plan", str(plan), "--model", str(model), "--prompt", "hi"]
    started = time.monotonic()
    done = hosts.run(command, host="head", timeout=DEADLINE_S, check=False)
    assert done.returncode == 2, done.stderr
    assert "10.213.0.99:6379" in done.stderr
    assert time.monotonic() - started < DEADLINE_S  # never a hang (the bound itself is 30 s)


def _stream(client: httpx.Client, prompt: str, max_tokens: int, started=None) -> list[str]:  # noqa: ANN001
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    texts = []
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                texts.append(json.loads(line[6:])["choices"][0]["text"])
                if started is not None and len(texts) == 4:
                    started.release()  # this stream runs
    return texts


@pytest.mark.parametrize("how", ["killed", "cut off"])
def test_a_host_lost_mid_stream_loses_no_request(hosts, tiny_dirs, tmp_path, how):
    """3 stages on head, h1, h2; h2 is lost while 8 streams run (its raylet and everything on it
    killed, or its link set down): the server re-plans on head and h1, every stream finishes with
    one process's text, the server answers again, and no stage process of the old pipeline is left
    on h1."""
    import concurrent.futures

    model = tiny_dirs["tied"]
    plan = write_plan(
        tmp_path / "plan.json", model, [(0, 2), (2, 4), (4, 5)], devices=["head/cpu0", "h1/cpu0", "h2/cpu0"]
    )
    port = 18080 if how == "killed" else 18081
    serve = [*TESSEL, "serve", "--model", str(model), "--plan", str(plan), "--heartbeat-timeout", "10"]
    prompts = [f"{p} {i}" for i in range(2) for p in PROMPTS]
    tokens = 160  # long enough that every stream is still running when the machine goes
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    expected = [out.text for out in LLM(model).generate(prompts, params, use_progress=False)]
    try:
        with hosts.serving(serve, port, tmp_path / "serve.log") as client:
            old_h1 = set(hosts.pids("h1"))
            running = threading.Semaphore(0)
            with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
                streams = [pool.submit(_stream, client, prompt, tokens, running) for prompt in prompts]
                for _ in prompts:
                    assert running.acquire(timeout=DEADLINE_S), "a stream did not start"
                lost_at = time.monotonic()
                if how == "killed":
                    hosts.kill_raylet("h2")
                else:
                    hosts.cut("h2")
                texts = ["".join(s.result(timeout=DEADLINE_S)) for s in streams]
                served_again_s = time.monotonic() - lost_at
            assert texts == expected  # no stream failed, none lost or repeated a token
            while client.get("/health").status_code != 200:
                assert time.monotonic() - lost_at < DEADLINE_S
                time.sleep(0.5)
            assert "".join(_stream(client, prompts[0], tokens)) == expected[0]
            assert served_again_s < DEADLINE_S
            left = set(hosts.pids("h1")) & old_h1
            stage_procs = [pid for pid in left if b"tessel.pipeline.stage.worker" in _cmdline(pid)]
            assert stage_procs == []
        log = (tmp_path / "serve.log").read_text()
        assert "stage 2 failed" in log and "h2" in log, log[-3000:]
    finally:
        hosts.restart("h2")


def _cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


@pytest.fixture(autouse=True)
def _no_stray_namespaces():
    yield
    assert shutil.which("ip") is not None


def test_probe_ray_measures_every_pair_and_a_slow_link_shows(hosts, tmp_path):
    """`tessel probe --ray`: one cluster file of the three machines, named by their labels, with each
    pair's measured link; h1's link limited to 100 Mbit/s (tc tbf) shows on both of its pairs."""
    import yaml

    hosts.shape("h1", mbit=100)
    try:
        out = tmp_path / "ray.yaml"
        hosts.run([*TESSEL, "probe", "--ray", "--out", str(out)], host="head", timeout=DEADLINE_S)
    finally:
        hosts.unshape("h1")
    data = yaml.safe_load(out.read_text())
    assert [node["name"] for node in data["nodes"]] == ["head", "h1", "h2"]  # this machine first
    links = {frozenset(link["between"]): link["bandwidth_gbps"] for link in data["links"]}
    assert set(links) == {frozenset(p) for p in (("h1", "h2"), ("h1", "head"), ("h2", "head"))}
    slow = [links[frozenset(("h1", other))] for other in ("h2", "head")]
    assert all(gbps < 0.2 for gbps in slow), links  # 100 Mbit/s, measured
    assert links[frozenset(("h2", "head"))] > 4 * max(slow), links
    assert data["network"]["bandwidth_gbps"] == min(links.values())


def test_a_machine_that_joins_is_priced_and_the_plan_grows_onto_it(hosts, smollm2_dir, tmp_path):
    """h2 leaves; the model is planned on the Ray cluster left (`plan --cluster ray`: head, h1) and
    served with --remap auto; h2 joins while requests run: it is probed, the plan re-made on the
    grown cluster takes it (the model says more stages gain), the server remaps live onto it, and
    every request answers as one process does. SmolLM2, not a tiny model: a tiny model's layers cost
    less than a link's latency, so whether a stage more gains is the probe's noise (seen: a plan of
    one stage, and a 17% "gain" from moving a stage between two alike machines)."""
    model = smollm2_dir
    hosts.leave("h2")
    try:
        plan = tmp_path / "plan.json"
        planning = [*TESSEL, "plan", "--model", str(model), "--cluster", "ray", "--json", str(plan)]
        hosts.run(planning, host="head", timeout=DEADLINE_S)
        before = [s["device"].split("/")[0] for s in json.loads(plan.read_text())["stages"]]
        assert "h2" not in before
        texts = dict(zip(PROMPTS, _expected_texts(model, PROMPTS, 8), strict=True))
        serve = [*TESSEL, "serve", "--model", str(model), "--plan", str(plan), "--remap", "auto"]
        serve += ["--remap-threshold", "0.05", "--remap-interval-s", "1"]  # a gain, not the probe's noise
        failures: list[str] = []
        stop = threading.Event()
        with hosts.serving(serve, 18083, tmp_path / "serve.log") as client:

            def load() -> None:
                for index in itertools.count():
                    if stop.is_set():
                        return
                    prompt = PROMPTS[index % len(PROMPTS)]
                    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
                    answer = client.post("/v1/completions", json=body)
                    if answer.status_code != 200 or answer.json()["choices"][0]["text"] != texts[prompt]:
                        failures.append(f"{answer.status_code}: {answer.text[:200]}")

            worker = threading.Thread(target=load, daemon=True)
            worker.start()
            hosts.join("h2")
            log = tmp_path / "serve.log"
            deadline = time.monotonic() + DEADLINE_S
            while "remapped" not in log.read_text():
                assert time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(1.0)
            time.sleep(3.0)  # requests on the grown pipeline
            stop.set()
            worker.join(DEADLINE_S)
        text = log.read_text()
        assert "h2 joined the Ray cluster" in text, text[-3000:]
        decision = next(line for line in text.splitlines() if "joined the cluster" in line)
        assert "remap decision" in decision and "h2/" in decision.split("->")[-1], decision
        assert len(before) == 2 and len(decision.split("->")[-1].split(" / ")) == 3, decision  # grown
        assert failures == []
    finally:
        if "h2" not in hosts.alive_nodes():
            hosts.join("h2")


def _expected_texts(model, prompts, max_tokens) -> list[str]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return [out.text for out in LLM(model).generate(prompts, params, use_progress=False)]
