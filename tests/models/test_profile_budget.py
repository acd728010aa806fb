"""`tessel profile --budget-s` bounds the whole command (issue 42): one deadline is shared by the decoder
layer's grids, the passes over several prompts, the embedding and LM head, the engine step and the
transport, each phase getting its share, and each timing loop stops at its phase's deadline with what it
has. Checked by counting timed runs under a fake clock (each run takes a fixed time of it), and by the
runs a loop makes once its deadline has passed; never by wall time."""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fake_clock import FakeTime  # noqa: E402
from tessel.deadline import Deadline  # noqa: E402
from tessel.profiling import components as C  # noqa: E402
from tessel.profiling import layer as P  # noqa: E402
from tessel.profiling.layer import LayerShape, ProfileSettings, profile_layer  # noqa: E402

SMALL = {"max_chunk_tokens": 64, "max_offset_tokens": 256, "max_decode_batch": 4, "max_decode_context": 256}
PASSED = 0.0  # seconds: a deadline that has passed when the loop starts


def test_the_whole_profile_keeps_within_its_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every phase runs (its fit is there), and the fake time spent ends within the budget plus the one
    round of timed runs a loop finishes once its deadline passes. The budgets range from about what
    the fewest runs the fits need take (some 70 runs here) to more than the whole grids take."""
    fake = FakeTime(run_s=1.0)
    monkeypatch.setattr(P, "_timer", lambda settings: fake.timer)
    budget_s = random.Random().uniform(100.0, 600.0)  # fresh each run: the bound holds over the range
    settings = ProfileSettings(budget_s=budget_s, **SMALL)
    shape, ends = LayerShape(64, 128, 4, 2, 16), C.EndsShape(64, 384)
    deadline = Deadline.after(budget_s, fake.now)
    profile, _, data = profile_layer(shape, settings, ends=ends, deadline=deadline)
    assert {"embed", "head"} <= set(profile.components)
    rounds = (C.EMBED_TOKENS, C.HEAD_ROWS, P.PREFILL_BATCH_SIZES, data.decode_points)
    largest_round = max(len(sizes) for sizes in rounds)
    assert fake.now_s <= budget_s + largest_round * fake.run_s, (fake.runs, budget_s)


def test_the_ends_take_one_round_once_their_deadline_has_passed() -> None:
    fake = FakeTime(run_s=1.0)
    settings = ProfileSettings(repeats=random.Random().randint(2, 50), warmup=1)
    sizes, times = C.measure_ends(C.EndsShape(32, 96), settings, fake.timer, Deadline.after(PASSED, fake.now))
    assert fake.runs == len(C.EMBED_TOKENS) + len(C.HEAD_ROWS)  # one timed run of each size
    assert all((t > 0).all() for t in times.values())


def test_the_step_times_the_fewest_sizes_a_fit_takes_once_its_deadline_has_passed(checkpoints, monkeypatch):
    monkeypatch.setattr(C, "STEP_TIMED", 2)
    settings = ProfileSettings(repeats=1, warmup=0)
    sizes, times = C.measure_step_overhead(checkpoints("llama"), settings, Deadline.after(PASSED))
    assert len(sizes) == C.MIN_FIT_SIZES and len(set(sizes)) == len(sizes) and (times > 0).all()
    assert {min(C.STEP_SEQUENCES), max(C.STEP_SEQUENCES)} <= set(sizes)  # the range a fit spans


def test_the_transport_times_one_round_once_its_deadline_has_passed() -> None:
    settings = ProfileSettings(repeats=1, warmup=0)
    sizes, best_s, rounds = C.measure_transport("host", settings, (256, 4096), 1000, Deadline.after(PASSED))
    assert rounds == 1 and list(sizes) == [256, 4096] and (best_s > 0).all() and np.isfinite(best_s).all()
