"""The component profiler times the engine's own embedding, LM head + sampling, step and transport:
each measurement is positive and sized as asked, and `profile_layer` stores their fits."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tessel.cost.profile import load_profile  # noqa: E402
from tessel.profiling import components as C  # noqa: E402
from tessel.profiling.layer import LayerShape, ProfileSettings, _Layer, profile_layer  # noqa: E402
from tessel.profiling.timing import make_clock  # noqa: E402

FAST = ProfileSettings(repeats=1, warmup=0, min_point_s=0.0, budget_s=0.2, max_chunk_tokens=64,
                       max_offset_tokens=256, max_decode_batch=4, max_decode_context=256)  # fmt: skip


def test_layer_copies_run_in_sequence_with_their_own_weights() -> None:
    two = _Layer(LayerShape(32, 48, 4, 2, 8), ProfileSettings(layer_copies=2), max_tokens=64, max_batch=2)
    positions, x, residual, meta = two.prefill_inputs(3, 0)
    with torch.inference_mode():
        out = two.forward(positions, x, residual, meta)
        h0, r0 = two.copies[0](positions, x, residual, meta)
        alone, _ = two.copies[1](positions, x, residual, meta)
        h1, r1 = two.copies[1](positions, h0, r0, meta)  # the model's own chaining of (hidden, residual)
    torch.testing.assert_close(out, h1 + r1)
    assert not torch.allclose(h0, alone)  # distinct weights


def test_ends_are_timed_at_every_size(tmp_path) -> None:
    sizes, times = C.measure_ends(C.EndsShape(32, 96), FAST, make_clock("wall"))
    assert list(sizes["embed"]) == list(C.EMBED_TOKENS) and list(sizes["head"]) == list(C.HEAD_ROWS)
    assert all((t > 0).all() and np.isfinite(t).all() for t in times.values())


def test_transport_is_timed_between_two_processes_over_gloo() -> None:
    sizes, times, rounds = C.measure_transport("host", FAST, sizes=(256, 4096, 65536), rounds=2)
    assert list(sizes) == [256, 4096, 65536] and (times > 0).all() and np.isfinite(times).all()
    assert rounds == 2  # no deadline: every round asked for
    with pytest.raises(C.TesselError, match="nccl"):
        C.measure_transport("nccl", FAST)  # not a CPU transport


def test_profile_stores_every_component_fit(checkpoints, tmp_path, monkeypatch) -> None:
    # fewer sizes, the same code: the step on a real (tiny) checkpoint
    monkeypatch.setattr(C, "STEP_SEQUENCES", (1, 2, 3, 4, 5, 6, 8))
    monkeypatch.setattr(C, "STEP_TIMED", 2)
    profile, _, _ = profile_layer(
        LayerShape(64, 128, 4, 2, 16), FAST, ends=C.EndsShape(64, 384), checkpoint=checkpoints("llama")
    )
    assert set(profile.components) == {"embed", "head", "step", "prefill_batch"}
    for name, fit in profile.components.items():
        assert fit.c0 >= 0 and fit.c1 >= 0 and np.isfinite(fit.heldout_rel_error), name
    assert profile.components["embed"].knots and profile.components["head"].shape == {
        "hidden_size": 64, "vocab_size": 384}  # fmt: skip
    assert profile.cpu_cores == C.host_cores() and profile.threads == torch.get_num_threads()
    path = tmp_path / "p.json"
    profile.save(path)
    assert load_profile(path) == replace(profile, meta=profile.to_json()["meta"])  # + the writer's version


def test_the_step_is_timed_on_the_engine_the_decode_points_model() -> None:
    """A CUDA profile of graph replays times the step on a graph-replaying engine (its inputs are
    prepared for the graph); every other profile on an eager one."""
    from types import SimpleNamespace

    from tessel.profiling.components import step_engine_eager

    assert not step_engine_eager(SimpleNamespace(device="cuda", cuda_graphs=True))
    assert step_engine_eager(SimpleNamespace(device="cuda", cuda_graphs=False))
    assert step_engine_eager(SimpleNamespace(device="cpu", cuda_graphs=True))


def test_model_calls_are_timed_apart_and_put_back() -> None:
    """`time_model_calls` adds each forward's and each sampling's seconds to its own entry (a fake
    clock: 1 s per read pair), and `restore` puts the runner's own methods back."""
    from types import SimpleNamespace

    from tessel.profiling.components import time_model_calls

    forward, sample = (lambda *a: "h"), (lambda *a: "t")
    runner = SimpleNamespace(_forward=forward, sample_hidden=sample)
    ticks = iter(range(100))
    spent, restore = time_model_calls(runner, lambda: float(next(ticks)), cuda=False)
    assert runner._forward(1) == "h" and runner._forward(2) == "h" and runner.sample_hidden() == "t"
    assert spent == {"forward": 2.0, "sample": 1.0}
    restore()
    assert runner._forward is forward and runner.sample_hidden is sample
