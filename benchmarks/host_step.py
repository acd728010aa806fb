"""The engine's host work per decode step, split by part, on a model whose arithmetic is negligible
(issue 47): 2 layers, hidden 64, float32, one thread.

    python benchmarks/host_step.py [--running 1,8,64,256] [--steps 60] [--rounds 3] [--before REV] \
        [--out PATH.jsonl]

Each tree (this one, and `--before REV`'s `src/` when given) is measured in its own child process,
the trees taking turns for `--rounds` rounds (a load change on a shared machine hits both alike);
each figure is the median over the rounds. For each count of running requests the child starts
that many requests (16 prompt tokens, greedy, `ignore_eos`, long enough never to finish), runs 8
steps untimed, then:

- `step`: `--steps` engine steps with nothing wrapped (wall time, median per step);
- the split, in two passes of as many steps, each part the median per step:
  1. a timer around each part called a few times a step, in the engine thread's CPU time
     (`time.thread_time`: what the step computes, not the time another process held the core):
     `schedule` (the scheduler), `prepare` (the step's input tensors), `forward` (the model: eager
     or a graph), `sample` (logits and sampling), `finish` (counting tokens, stop rules, outputs),
     and `other` (the step less those: the engine's loop around them); `host` is the step less
     `forward`, step by step: what the step costs beside the model;
  2. a timer around each call made once per request a step, `detokenise` and `output` (taken out
     of `finish`), on the wall clock (a thread-time read is a system call), less each call's timer
     cost as measured in the same process. Since issue 47 a request without stop strings (these)
     is detokenized only when its output's text is read, which no step here does: its
     `detokenise` is 0, and the contract floor still counts one `DecodeStream` step.

The tiny model's tokenizer is word-level (see `tiny_model`): a random model under a byte-level
tokenizer emits broken UTF-8 that a trained model does not.

`--waiting` adds requests that wait behind `max_num_seqs` (8 running): a step's host work must not
grow with them. Timings are medians: the machine's load is in each record (`machine.load_average`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _harness

PROMPT_TOKENS = 16
WARM_STEPS = 8
PARTS = ("schedule", "prepare", "forward", "sample", "finish", "detokenise", "output")


# ---- in the child: one tree ---------------------------------------------------------------------
def tiny_model(folder: Path) -> Path:
    """The tiny Llama with a word-level tokenizer of the same vocabulary size: a random model's
    greedy tokens under the tests' byte-level tokenizer are mostly broken UTF-8, which a trained
    model's are not (each waits in the detokenizer's window); here every token is a whole word."""
    tiny = _harness.tests_module("tiny_models")
    path = tiny.make_tiny_checkpoint(
        folder / "tiny",
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_kv_heads=2,
        seed=0,
    )
    word_tokenizer(tiny.build_tokenizer()).save_pretrained(path)
    return path


def word_tokenizer(like):
    """A Metaspace word-level tokenizer (SentencePiece-style "\u2581word" tokens) with `like`'s
    vocabulary size and special tokens in the same places."""
    import random
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(0)
    vocab = {token: like.convert_tokens_to_ids(token) for token in like.all_special_tokens}
    while len(vocab) < len(like):
        word = "\u2581" + "".join(rng.choices(string.ascii_lowercase, k=rng.randint(2, 7)))
        if word not in vocab:
            free = min(set(range(len(like))) - set(vocab.values()))
            vocab[word] = free
    backend = Tokenizer(models.WordLevel(vocab, unk_token=like.unk_token))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    special = {name: getattr(like, name) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return PreTrainedTokenizerFast(tokenizer_object=backend, **special)


class Split:
    """Seconds per part of the current step, from timers wrapped around the engine's parts."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._patched: list[tuple[object, str, object, bool]] = []

    def wrap(self, owner: object, attr: str, part: str) -> None:
        inner, clock = getattr(owner, attr), self.clock
        seconds, calls = self.seconds, self.calls
        seconds[part], calls[part] = 0.0, 0
        self._patched.append((owner, attr, vars(owner).get(attr), attr in vars(owner)))

        def timed(*args, **kwargs):
            start = clock()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[part] += clock() - start
                calls[part] += 1

        setattr(owner, attr, timed)

    def restore(self) -> None:
        """Every wrapped attribute as it was (an instance's own again, or the class's)."""
        for owner, attr, original, had_own in reversed(self._patched):
            if had_own:
                setattr(owner, attr, original)
            else:
                delattr(owner, attr)
        self._patched.clear()

    def take(self) -> tuple[dict[str, float], dict[str, int]]:
        taken, counted = dict(self.seconds), dict(self.calls)
        for part in self.seconds:
            self.seconds[part], self.calls[part] = 0.0, 0
        return taken, counted


def timer_cost_s(clock) -> float:
    """What one wrapped call adds to what it times: a no-op timed, less the no-op called."""
    split = Split(clock)

    class Box:
        def noop(self) -> None:
            return None

    box, calls = Box(), 20000
    start = time.perf_counter()
    for _ in range(calls):
        box.noop()
    plain = time.perf_counter() - start
    split.wrap(box, "noop", "noop")
    start = time.perf_counter()
    for _ in range(calls):
        box.noop()
    return max((time.perf_counter() - start - plain) / calls, 0.0)


def per_step_split(llm, steps: int) -> dict[str, list[float]]:
    """Pass 1: the parts called a few times a step (thread CPU time; the timers' cost negligible)."""
    split = Split(time.thread_time)
    runner = llm.runner
    split.wrap(llm.scheduler, "schedule", "schedule")
    split.wrap(runner, "prepare", "prepare")
    split.wrap(runner, "_forward", "forward")
    split.wrap(runner, "sample_hidden", "sample")
    split.wrap(llm, "_finish_step", "finish")
    found: dict[str, list[float]] = {part: [] for part in (*split.seconds, "other", "host")}
    for _ in range(steps):
        start = time.thread_time()
        llm.step()
        total = time.thread_time() - start
        taken, _ = split.take()
        for part, value in taken.items():
            found[part].append(value)
        found["other"].append(total - sum(taken.values()))
        found["host"].append(total - taken["forward"])
    split.restore()
    return found


def per_request_split(llm, steps: int) -> dict[str, list[float]]:
    """Pass 2: the parts called once per request a step, on the cheap wall clock, each call's timer
    cost (measured) taken off."""
    from tessel.engine import detokenizer

    cost = timer_cost_s(time.perf_counter)
    split = Split(time.perf_counter)
    split.wrap(llm, "_output", "output")
    split.wrap(detokenizer.IncrementalDetokenizer, "add_token", "detokenise")
    found: dict[str, list[float]] = {"output": [], "detokenise": []}
    for _ in range(steps):
        llm.step()
        taken, calls = split.take()
        for part in found:
            found[part].append(max(taken[part] - calls[part] * cost, 0.0))
    split.restore()
    return found


def contract_floor_us(model: Path, running: int, steps: int) -> float:
    """A floor under `finish` + `detokenise` + `output` per step: for each request only what the
    engine's contract asks (its token appended, one `DecodeStream` step, one `RequestOutput` with
    its own metrics), in a bare loop, median per step."""
    from tokenizers.decoders import DecodeStream
    from transformers import AutoTokenizer

    from tessel.engine.outputs import RequestOutput
    from tessel.engine.sequence import RequestMetrics

    backend = AutoTokenizer.from_pretrained(str(model))._tokenizer
    tokens = [[5 + (i + k) % 200 for k in range(PROMPT_TOKENS)] for i in range(running)]
    streams = [DecodeStream(ids=t[-5:], skip_special_tokens=True) for t in tokens]
    found = []
    for step in range(steps):
        start = time.perf_counter()
        for i in range(running):
            token = 5 + (i + step) % 300
            tokens[i].append(token)
            streams[i].step(backend, token)
            RequestOutput(
                f"r{i}", tokens[i], tokens[i][PROMPT_TOKENS:], [token], "", "", False, None,
                PROMPT_TOKENS, step + 1, RequestMetrics(0.0, 0.0, 0.0),
            )  # fmt: skip
        found.append(time.perf_counter() - start)
    return statistics.median(found) * 1e6


def measure_running(model: Path, running: int, waiting: int, steps: int) -> dict:
    import torch

    from tessel import LLM, SamplingParams

    torch.set_num_threads(1)
    max_tokens = WARM_STEPS + 3 * steps + 16
    llm = LLM(str(model), max_num_seqs=max(running, 1), max_model_len=PROMPT_TOKENS + max_tokens + 16)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(running + waiting):
        prompt = [5 + (i + k) % 200 for k in range(PROMPT_TOKENS)]
        llm.add_request(f"r{i}", prompt, params)
    for _ in range(WARM_STEPS):
        llm.step()
    wall = []
    for _ in range(steps):
        w = time.perf_counter()
        llm.step()
        wall.append(time.perf_counter() - w)
    median_us = {k: statistics.median(v) * 1e6 for k, v in per_step_split(llm, steps).items()}
    median_us.update({k: statistics.median(v) * 1e6 for k, v in per_request_split(llm, steps).items()})
    median_us["finish"] -= median_us["detokenise"] + median_us["output"]  # counted apart
    assert len(llm.scheduler.running) == running, "every request ran through the timed steps"
    return {
        "running": running,
        "waiting": waiting,
        "steps": steps,
        "step_us": statistics.median(wall) * 1e6,
        "host_us": median_us.pop("host"),
        "contract_floor_us": contract_floor_us(model, running, steps),
        "parts_us": {part: median_us[part] for part in (*PARTS, "other")},
    }


def child(spec: dict) -> None:
    with tempfile.TemporaryDirectory(prefix="host-step-") as folder:
        model = tiny_model(Path(folder))
        rows = [measure_running(model, n, 0, spec["steps"]) for n in spec["running"]]
        rows += [measure_running(model, 8, w, spec["steps"]) for w in spec["waiting"]]
    print(json.dumps(rows))


# ---- the parent: trees, table, record ------------------------------------------------------------
def measure_tree(src: Path, spec: dict) -> list[dict]:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(src), str(_harness.TESTS)]),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, __file__, "--child", json.dumps(spec)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"the run on {src} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_rows(rounds: list[list[dict]]) -> list[dict]:
    """Row by row, the median over the rounds of every figure."""
    rows = []
    for same in zip(*rounds, strict=True):
        row = dict(same[0])
        for key in ("step_us", "host_us", "contract_floor_us"):
            row[key] = statistics.median(r[key] for r in same)
        row["parts_us"] = {p: statistics.median(r["parts_us"][p] for r in same) for p in same[0]["parts_us"]}
        rows.append(row)
    return rows


def table(tree: str, rows: list[dict]) -> str:
    head = (
        f"{'tree':<7} {'running':>7} {'waiting':>7} {'step us':>8} {'host us':>8} {'floor us':>8} "
        + " ".join(f"{part[:9]:>9}" for part in (*PARTS, "other"))
    )
    lines = [head]
    for r in rows:
        parts = " ".join(f"{r['parts_us'][part]:>9.0f}" for part in (*PARTS, "other"))
        lines.append(
            f"{tree:<7} {r['running']:>7} {r['waiting']:>7} {r['step_us']:>8.0f} {r['host_us']:>8.0f} "
            f"{r['contract_floor_us']:>8.0f} {parts}"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", default="1,8,64,256", help="counts of running requests")
    parser.add_argument("--waiting", default="0,1024", help="waiting requests beside 8 running")
    parser.add_argument("--steps", type=int, default=60, help="timed steps per count (each way)")
    parser.add_argument("--rounds", type=int, default=3, help="turns of each tree")
    parser.add_argument("--before", help="also measure this revision's src/")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    _harness.add_record_options(parser, "host_step")
    args = parser.parse_args()
    if args.child:
        child(json.loads(args.child))
        return
    spec = {
        "running": [int(n) for n in args.running.split(",") if n],
        "waiting": [int(n) for n in args.waiting.split(",") if n],
        "steps": args.steps,
    }
    print(_harness.machine_line())
    trees = {"after": _harness.REPO / "src"}
    result: dict = {"spec": spec, "trees": {}}
    with tempfile.TemporaryDirectory(prefix="host-step-before-") as folder:
        if args.before:
            from house_ab import export_src

            trees = {"before": export_src(args.before, Path(folder)), **trees}
            result["before_rev"] = args.before
        runs: dict[str, list[list[dict]]] = {name: [] for name in trees}
        for _ in range(args.rounds):
            for name, src in trees.items():
                runs[name].append(measure_tree(src, spec))
    for name, rounds in runs.items():
        result["trees"][name] = median_rows(rounds)
        print(table(name, result["trees"][name]), flush=True)
    _harness.append_record(args.out, "host_step", result, args.label)


if __name__ == "__main__":
    main()
