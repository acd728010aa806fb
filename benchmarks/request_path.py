"""Which source files one request crosses under `tessel serve --plan`, before and after a change of
the code's house (issue 43): the serving process (HTTP server, engine, stage 0) of a 2-stage plan
of SmolLM2 on CPUs, each tree in turn.

    python benchmarks/request_path.py [--before REV] [--model DIR] [--out PATH.jsonl]

`tessel serve --plan` runs in a child process with a profile hook on every thread (`sys.setprofile`,
`threading.setprofile`) that, while a flag is up, notes the file of every Python function called
under `src/tessel`, with the thread that called it. One request warms the server up, then the flag
goes up for one completion request (8 tokens, greedy) and down when its answer is in. Printed: the
files the request's threads crossed (the HTTP loop, the engine thread, the token receivers), and
apart those only threads beside it touched meanwhile (watchers, heartbeats: `BESIDE`); the other
stage's process is not traced.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import _harness
from house_ab import BEFORE_REV, ROOT, export_src

CHILD = r"""
import json, os, sys, threading, time
root, port, out = {root!r}, {port}, {out!r}
seen, tracing = set(), [False]

def note(frame, event, arg):
    if tracing[0] and event == "call" and frame.f_code.co_filename.startswith(root):
        seen.add((threading.current_thread().name, os.path.relpath(frame.f_code.co_filename, root)))

def drive():
    import httpx
    url = f"http://127.0.0.1:{{port}}"
    while True:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                break
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    body = {{"prompt": "Hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": True}}
    httpx.post(url + "/v1/completions", json=body, timeout=600)
    tracing[0] = True
    answer = httpx.post(url + "/v1/completions", json=body, timeout=600)
    tracing[0] = False
    with open(out, "w") as f:
        json.dump({{"status": answer.status_code, "calls": sorted(seen)}}, f)
    os._exit(0)

sys.setprofile(note)
threading.setprofile(note)
threading.Thread(target=drive, daemon=True).start()
sys.argv = ["tessel", "serve", "--model", {model!r}, "--plan", {plan!r}, "--port", str(port),
            "--log-level", "warning"]
from tessel.cli import main
main()
"""


# threads that run beside the request, not for it: the watchers, heartbeats and sampling of stages
BESIDE = re.compile(r"watch|heartbeat|beat|remap|supervis", re.IGNORECASE)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def crossed(src: Path, model: Path, plan: Path, work: Path) -> dict:
    out = work / f"path-{src.parent.name}.json"
    paths = {"root": str(src / "tessel"), "out": str(out), "model": str(model), "plan": str(plan)}
    code = CHILD.format(port=free_port(), **paths)
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=1800)
    if not out.exists():
        raise RuntimeError(f"the server on {src} wrote no trace:\n{done.stderr[-3000:]}")
    found = json.loads(out.read_text())
    calls = [tuple(call) for call in found["calls"]]
    on_path = sorted({file for thread, file in calls if not BESIDE.search(thread)})
    beside = sorted({file for thread, file in calls if BESIDE.search(thread)} - set(on_path))
    threads = sorted({thread for thread, _ in calls})
    return {"status": found["status"], "files": on_path, "beside": beside, "threads": threads}


def run(args: argparse.Namespace) -> dict:
    pipeline_plans = _harness.tests_module("pipeline_plans")
    model = _harness.example_model(args.model)
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    with tempfile.TemporaryDirectory(prefix="request-path-") as folder:
        work = Path(folder)
        plan = pipeline_plans.write_plan(work / "plan.json", model, [(0, layers // 2), (layers // 2, layers)])
        before = export_src(args.before, work / "before")
        trees = {"before": before, "after": ROOT / "src"}
        found = {side: crossed(src, model, plan, work) for side, src in trees.items()}
    return {"before": args.before, "model": str(model), **found}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", default=BEFORE_REV, help="git revision of the 'before' tree")
    parser.add_argument("--model", help="model directory (default: SmolLM2, `tessel example-model`)")
    _harness.add_record_options(parser, "request_path")
    args = parser.parse_args()
    print(_harness.machine_line(), flush=True)
    result = run(args)
    for side in ("before", "after"):
        found = result[side]
        files = found["files"]
        listed = ", ".join(files)
        print(f"{side}: HTTP {found['status']}, {len(files)} files on the request's threads: {listed}")
        print(
            f"  and {len(found['beside'])} only on threads beside it ({', '.join(found['threads'])}): "
            f"{', '.join(found['beside'])}"
        )
    _harness.append_record(args.out, "request_path", result, args.label)


if __name__ == "__main__":
    main()
