"""How steady this machine is: the same work timed over minutes, alone and beside a second process.

    python benchmarks/machine_noise.py [--minutes 3] [--window-s 10] [--quick] [--label NAME]

The floor under issue 30's fidelity targets: a prediction is priced from a profile taken at one
moment and compared with a run at another, so it cannot be held closer than the machine holds its
own speed. The work is what the profile and the engine time: SmolLM2-135M's decoder layer
(`tessel.profiling.layer._Layer`, 15 copies with their own weights, 1 torch thread, process CPU
time), a decode step of one sequence (memory-bound) and a 128-token prefill chunk (compute-bound).

Windows of `--window-s` seconds alternate: the layer timed alone, then timed while a second process
runs the same loop (as two pipeline stages on two cores do). Per window: the median of its runs.
Printed and recorded (benchmarks/results/machine_noise.jsonl): per kind of work, the spread of the
alone windows (max / min of their medians) and each co-run window against the alone windows on
either side of it. The machine's load average is recorded before and after: run it alone.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

import _harness
from rich.console import Console
from rich.table import Table

SHAPE = (576, 1536, 9, 3, 64)  # SmolLM2-135M: hidden, intermediate, heads, kv heads, head dim
COPIES = 15
PREFILL_TOKENS = 128


def _layer_runs():  # noqa: ANN202
    """{work: run function} on SmolLM2's layer, 1 thread, timed by process CPU time."""
    import torch

    from tessel.profiling.layer import LayerShape, ProfileSettings, _Layer
    from tessel.profiling.timing import make_clock

    torch.set_num_threads(1)
    layer = _Layer(LayerShape(*SHAPE), ProfileSettings(layer_copies=COPIES), max_tokens=256, max_batch=2)
    inputs = {"decode": layer.decode_inputs(1, 64), "prefill": layer.prefill_inputs(PREFILL_TOKENS, 0)}

    clock = make_clock("cpu")
    return lambda work: clock(lambda: layer.forward(*inputs[work]))


def _co_runner(stop) -> None:  # noqa: ANN001
    """The second process: the same decode and prefill loop until told to stop."""
    import torch

    run = _layer_runs()
    with torch.inference_mode():
        while not stop.is_set():
            run("decode")
            run("prefill")


def measure(minutes: float, window_s: float) -> list[dict]:
    """Alternating windows (alone, co-run, alone, ...): per window, the median seconds per work."""
    import torch

    run = _layer_runs()
    context = mp.get_context("spawn")
    windows, deadline, kind = [], time.monotonic() + minutes * 60, "alone"
    with torch.inference_mode():
        for work in ("decode", "prefill"):
            run(work)
        while True:
            stop, helper = context.Event(), None
            if kind == "co-run":
                helper = context.Process(target=_co_runner, args=(stop,), daemon=True)
                helper.start()
                time.sleep(3.0)  # its layer built and looping
            times: dict[str, list[float]] = {"decode": [], "prefill": []}
            ends = time.monotonic() + window_s
            while time.monotonic() < ends:
                for work in times:
                    times[work].append(run(work))
            if helper is not None:
                stop.set()
                helper.join()
            windows.append({"kind": kind, "runs": len(times["decode"])} | {
                f"{work}_s": statistics.median(values) for work, values in times.items()
            })  # fmt: skip
            print(
                f"   {kind}: " + ", ".join(f"{w} {windows[-1][w + '_s'] * 1e3:.2f} ms" for w in times),
                flush=True,
            )
            if (
                time.monotonic() >= deadline and kind == "alone"
            ):  # the last co-run has alone windows beside it
                break
            kind = "co-run" if kind == "alone" else "alone"
    return windows


def summarise(windows: list[dict]) -> dict:
    """Per work: the alone windows' spread (max / min) and each co-run window over the mean of the
    alone windows beside it."""
    out = {}
    for work in ("decode", "prefill"):
        key = f"{work}_s"
        alone = [w[key] for w in windows if w["kind"] == "alone"]
        ratios = [
            w[key] / statistics.mean([windows[i - 1][key], windows[i + 1][key]])
            for i, w in enumerate(windows)
            if w["kind"] == "co-run" and 0 < i < len(windows) - 1
        ]
        out[work] = {
            "alone_min_s": min(alone),
            "alone_max_s": max(alone),
            "alone_spread": max(alone) / min(alone),
            "corun_over_alone": ratios,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=3.0)
    parser.add_argument("--window-s", type=float, default=10.0)
    parser.add_argument("--quick", action="store_true", help="20 s in 4 s windows: a smoke run")
    _harness.add_record_options(parser, "machine_noise")
    args = parser.parse_args()
    minutes, window_s = (1 / 3, 4.0) if args.quick else (args.minutes, args.window_s)
    console = Console(highlight=False)
    console.print(_harness.machine_line())
    load_before = os.getloadavg()
    windows = measure(minutes, window_s)
    summary = summarise(windows)
    table = Table(
        title=f"the same layer work over {minutes:g} min, {window_s:g} s windows (1 thread, CPU time)"
    )
    for column in ("work", "alone min ms", "alone max ms", "alone max/min", "co-run / alone beside it"):
        table.add_column(column, justify="right")
    for work, s in summary.items():
        ratios = ", ".join(f"{r:.2f}" for r in s["corun_over_alone"]) or "-"
        table.add_row(work, f"{s['alone_min_s'] * 1e3:.2f}", f"{s['alone_max_s'] * 1e3:.2f}",
                      f"{s['alone_spread']:.2f}x", ratios)  # fmt: skip
    console.print(table)
    result = {"minutes": minutes, "window_s": window_s, "windows": windows, "summary": summary,
              "loadavg_before": load_before, "loadavg_after": os.getloadavg()}  # fmt: skip
    _harness.append_record(args.out, "machine_noise", result, args.label)


if __name__ == "__main__":
    main()
