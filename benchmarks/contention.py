"""How much the decoder layer slows beside a co-runner on this CPU, and whether it is the memory or the
core (issue 48): the profile's measurement (`tessel.profiling.contention`) with a choice of co-runner.

    python benchmarks/contention.py [--co-runner layer,python] [--rounds 20] [--half-s 0.5] [--out PATH.jsonl]

SmolLM2's layer shape (float32, one thread, 30 copies streaming from memory, 4 rows of 256-token
contexts) is timed in interleaved rounds: `--half-s` seconds of runs with the co-runner held, then as
long with it running, `--rounds` times; the figure is the ratio of the medians (beside / alone). Two
co-runners: `layer`, a process running the same layer (its weights through the same memory), and
`python`, a process spinning in pure Python (a busy core, no memory traffic). One after the other.
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import _harness

from tessel.profiling import contention as C


def spin(threads: int, events: dict) -> None:
    """A co-runner that keeps a core busy in Python, no memory traffic."""
    events["ready"].set()
    x = 0
    while not events["stop"].is_set():
        if events["go"].is_set():
            for i in range(20000):
                x += i
            events["active"].set()
        else:
            events["active"].clear()
            events["go"].wait(0.05)


def measure(kind: str, rounds: int, half_s: float) -> dict:
    import multiprocessing

    import torch

    from tessel.profiling.layer import LayerShape, ProfileSettings, _Layer
    from tessel.profiling.timing import make_clock

    make_layer = partial(
        _Layer, LayerShape(576, 1536, 9, 3, 64), ProfileSettings(layer_copies=30), C.MAX_TOKENS, 4
    )
    layer = make_layer()
    context = multiprocessing.get_context("spawn")
    events = {name: context.Event() for name in ("go", "active", "stop", "ready")}
    target = C.co_run if kind == "layer" else spin
    args = (make_layer, 1, events) if kind == "layer" else (1, events)
    proc = context.Process(target=target, args=args, daemon=True)
    proc.start()
    runners = [(proc, events)]
    try:
        C.wait_started(runners)
        started = time.perf_counter()
        with torch.inference_mode():
            inputs = C.decode_inputs(layer)
            clock = make_clock("cpu")
            alone, beside = C.alone_and_beside(layer, inputs, runners, clock, None, rounds, half_s)
    finally:
        events["stop"].set()
        events["go"].set()
        proc.join(10)
    return {
        "co_runner": kind,
        "alone_ms": alone * 1e3,
        "beside_ms": beside * 1e3,
        "ratio": beside / alone,
        "seconds": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--co-runner", default="layer,python", help="layer, python or both")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--half-s", type=float, default=0.5, help="seconds of runs each way per round")
    _harness.add_record_options(parser, "contention")
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    print(_harness.machine_line())
    rows = []
    for kind in args.co_runner.split(","):
        if kind not in ("layer", "python"):
            parser.error(f"--co-runner: {kind!r} is neither layer nor python")
        row = measure(kind, args.rounds, args.half_s)
        rows.append(row)
        print(f"beside a {kind} co-runner: {row['beside_ms']:.2f} ms against {row['alone_ms']:.2f} ms alone, "
              f"{row['ratio']:.3f}x ({row['seconds']:.0f} s)", flush=True)  # fmt: skip
    spec = {"rounds": args.rounds, "half_s": args.half_s, "shape": "smollm2 layer, 30 copies, 4 rows x 256"}
    _harness.append_record(args.out, "contention", {"spec": spec, "rows": rows}, args.label)


if __name__ == "__main__":
    main()
