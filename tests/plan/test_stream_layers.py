"""Whole streamed layers (`stream_layers`): the planner prices the layers the runtime copies each
pass (`tessel.plan.streamed`), not only the bytes beyond device memory. The DP against the brute
force, the MILP as a bound, and a CPU's copies priced on its compute (`copies_share_compute`)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from plan.random_instances import random_instance
from tessel.plan.solution import Solution, evaluate, stage_layer_bytes
from tessel.plan.solvers.brute import brute_force
from tessel.plan.solvers.dp import solve_dp
from tessel.plan.solvers.milp import solve_milp
from tessel.plan.streamed import copied_bytes, offload_layers, streamed_count


def _streaming(rng: np.random.Generator, n_units: int, *, granularity: str, overlap: bool, shared: bool):
    base = random_instance(rng, n_units, 3, offload=True, tight_memory=True, overlap=overlap,
                           granularity=granularity)  # fmt: skip
    devices = tuple(replace(d, copies_share_compute=shared and i % 2 == 0)
                    for i, d in enumerate(base.devices))  # fmt: skip
    return replace(base, devices=devices, stream_layers=True)


@pytest.mark.parametrize("seed", range(8))
def test_dp_equals_brute_force_and_milp_bounds_it(seed):
    rng = np.random.default_rng(3100 + seed)
    granularity = "sublayer" if seed % 4 == 3 else "layer"
    instance = _streaming(rng, int(rng.integers(4, 8)), granularity=granularity, overlap=seed % 2 == 0,
                          shared=seed % 3 != 0)  # fmt: skip
    brute = brute_force(instance)
    dp = solve_dp(instance, orders="all")
    milp = solve_milp(instance, mip_gap=0.0, time_limit_s=30)
    if brute.solution is None:
        assert dp.solution is None and milp.solution is None
        return
    best = brute.evaluation.objective
    assert dp.exact and dp.evaluation.objective == pytest.approx(best, rel=1e-6)
    # the MILP prices streamed bytes, not whole layers: its bound is below, its plan (re-priced) above
    assert milp.bound <= best * (1 + 1e-6)
    assert milp.evaluation.feasible and milp.evaluation.objective >= best * (1 - 1e-6)


def test_the_swap_in_is_the_whole_streamed_layers_the_runtime_picks():
    rng = np.random.default_rng(7)
    instance = _streaming(rng, 8, granularity="layer", overlap=True, shared=False)
    device = instance.devices[0]
    held = instance.weight_bytes.sum() + instance.kv_bytes.sum() + instance.workspace_bytes[0]
    held += instance.first_bytes + instance.last_bytes
    over = 2.5 * float(instance.weight_bytes.max())  # a few layers beyond memory, within the host
    instance = replace(instance, devices=(replace(device, memory_bytes=held - over, host_bytes=held),
                                          *instance.devices[1:]))  # fmt: skip
    stage = evaluate(instance, Solution.from_counts([0], [8])).stages[0]
    layers = offload_layers(0, list(instance.weight_bytes), stage.offload_bytes)
    assert len(layers) == streamed_count(list(instance.weight_bytes), stage.offload_bytes) >= 3
    assert stage.streamed_bytes == pytest.approx(float(instance.weight_bytes[layers].sum()), rel=1e-12)
    assert stage.offload_s == pytest.approx(stage.streamed_bytes / device.host_to_device_bytes_per_s)
    plain = evaluate(replace(instance, stream_layers=False), Solution.from_counts([0], [8])).stages[0]
    assert plain.offload_s == pytest.approx(stage.offload_bytes / device.host_to_device_bytes_per_s)
    assert stage.offload_s > plain.offload_s


def test_copied_bytes_covers_what_streaming_cannot_free():
    assert copied_bytes([1.0] * 6, 2.5) == 5.0  # 5 layers free 3 (two stay as buffers)
    assert copied_bytes([1.0] * 3, 2.5) == 4.5  # all 3 free 1: the other 1.5 priced per byte
    assert copied_bytes([4.0, 1.0, 1.0], 0.0) == 0.0


def test_sublayer_units_stream_as_their_layers():
    rng = np.random.default_rng(11)
    instance = _streaming(rng, 6, granularity="sublayer", overlap=False, shared=False)
    w = instance.weight_bytes
    assert stage_layer_bytes(instance, 1, 6) == pytest.approx([w[1], w[2] + w[3], w[4] + w[5]])


def test_a_cpu_copies_on_its_compute_cores():
    rng = np.random.default_rng(5)
    instance = _streaming(rng, 6, granularity="layer", overlap=True, shared=False)
    plan = Solution.from_counts([0, 1], [3, 3])
    apart = evaluate(instance, plan).stages[0]
    shared_devices = (replace(instance.devices[0], copies_share_compute=True), *instance.devices[1:])
    shared = evaluate(replace(instance, devices=shared_devices), plan).stages[0]
    assert (shared.compute_decode_s, shared.comm_decode_s) == (apart.compute_decode_s, apart.comm_decode_s)
    assert apart.offload_s > 0 and shared.offload_s == apart.offload_s
    assert apart.time_decode_s == pytest.approx(
        max(apart.compute_decode_s, apart.comm_decode_s, apart.offload_s)
    )
    assert shared.time_decode_s == pytest.approx(
        max(shared.compute_decode_s + shared.offload_s, shared.comm_decode_s)
    )
