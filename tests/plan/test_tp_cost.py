"""A tensor-parallel stage's price against a hand computation (ring all-reduce, sharded weights, memory)."""

from __future__ import annotations

import numpy as np
import pytest

from plan.tp_cases import cluster, problem, small_model, workload
from tessel.catalog.gpus import get_gpu
from tessel.cost import layer as L
from tessel.cost.link import LinkSpec
from tessel.cost.roofline import unit_decode_time_s, unit_prefill_time_s
from tessel.cost.tensor_parallel import TensorParallel, allowed_degrees, degree_problem, shard_model
from tessel.plan.files.cluster import NVLINK_LATENCY_S, PCIE_P2P_LATENCY_S
from tessel.plan.tp.tp_instance import ring_link, tp_instance


def test_ring_all_reduce_by_hand() -> None:
    link = LinkSpec(100e9, 5e-6)
    n = 8192 * 2 * 16  # 16 tokens of hidden 8192 in fp16
    # 4 ranks: 2 * 3 steps, each n/4 bytes over the link plus its latency
    assert TensorParallel(4, link).all_reduce_s(n) == pytest.approx(6 * (5e-6 + n / 4 / 100e9))
    assert TensorParallel(1, link).all_reduce_s(n) == 0.0
    assert TensorParallel(4, link).all_gather_s(n) == pytest.approx(3 * (5e-6 + n / 4 / 100e9))


def test_sharded_weights_and_kv_split_by_degree() -> None:
    model = small_model()
    for d in (2, 4, 8):
        shard = shard_model(model, d)
        h = model.hidden_size
        norms = 2 * h * 2  # two RMSNorm vectors per layer, fp16, kept whole on every rank
        assert L.weight_bytes(shard, "layer", "fp16") * d == pytest.approx(
            L.weight_bytes(model, "layer", "fp16") + (d - 1) * norms
        )
        assert L.kv_bytes_per_token(shard) * d == L.kv_bytes_per_token(model)
    assert allowed_degrees(model, 8) == (1, 2, 4, 8) and allowed_degrees(model, 4) == (1, 2, 4)


def test_degree_must_divide_heads_and_kv_heads() -> None:
    from dataclasses import replace

    model = replace(small_model(), num_heads=12, num_kv_heads=6)
    assert degree_problem(model, 8) == "degree 8 does not divide the 12 heads of llama-3-70b"
    assert degree_problem(model, 4) == "degree 4 does not divide the 6 KV heads of llama-3-70b"
    assert degree_problem(replace(model, num_heads=16, num_kv_heads=2), 4).endswith(
        "the 2 KV heads of llama-3-70b"
    )
    assert allowed_degrees(replace(model, num_heads=16, num_kv_heads=2), 8) == (1, 2)
    assert degree_problem(model, 3).startswith("tensor-parallel degree 3 is not one of 1, 2, 4, 8")


@pytest.mark.parametrize(
    ("gpu", "link", "latency_s"),
    [("A100-80G", "nvlink", NVLINK_LATENCY_S), ("T4", "pcie", PCIE_P2P_LATENCY_S)],
)
def test_tp_group_priced_as_a_shard_plus_two_all_reduces(gpu: str, link: str, latency_s: float) -> None:
    model, the_workload = small_model(), workload(batch=4, micro_batches=2, prompt=256, output=64)
    the_cluster = cluster(("n0", gpu, 4, link), host_gib=64)
    base, ctx = problem(model, the_cluster, the_workload)
    group = tuple(d.name for d in the_cluster.devices)
    inst = tp_instance(base, ctx, (group,))
    spec = get_gpu(gpu)
    bandwidth = spec.nvlink_bytes_per_s if link == "nvlink" else spec.pcie_h2d_bytes_per_s
    assert ring_link(the_cluster, group) == LinkSpec(bandwidth, latency_s)
    shard = shard_model(model, 4)

    def all_reduce(tokens: int) -> float:  # by hand: 2 (d - 1) steps of h * tokens * 2 / d bytes
        return 2 * 3 * (latency_s + model.hidden_size * tokens * 2 / 4 / bandwidth)

    b, prompt, context = 2, 256, 256 + 32  # 4 requests in 2 micro-batches; mean decode context
    decode = unit_decode_time_s(shard, spec, "layer", b, b * context) + 2 * all_reduce(b)
    prefill = unit_prefill_time_s(shard, spec, "layer", prompt, 0, batch_size=b) + 2 * all_reduce(b * prompt)
    assert np.allclose(inst.decode.unit_time_s[:, 0], decode, rtol=1e-12)
    assert np.allclose(inst.prefill.unit_time_s[:, 0], prefill, rtol=1e-12)
    # memory: each rank holds 1/4, so the group holds 4 GPUs' worth; its host link is the four ranks'
    slot = inst.devices[0]
    assert slot.tp_degree == 4 and slot.gpus == group
    assert slot.memory_bytes == pytest.approx(4 * base.devices[0].memory_bytes)
    assert slot.host_to_device_bytes_per_s == pytest.approx(4 * base.devices[0].host_to_device_bytes_per_s)
    assert inst.workspace_bytes[0] == pytest.approx(4 * L.workspace_bytes(shard, b * prompt, "fp16"))
    # the KV and weights the instance holds are the model's, whole
    assert np.array_equal(inst.kv_bytes, base.kv_bytes) and np.array_equal(
        inst.weight_bytes, base.weight_bytes
    )


def test_degree_one_groups_keep_the_base_numbers() -> None:
    the_cluster = cluster(("a", "A100-80G", 2, "nvlink"), ("b", "T4", 2, "pcie"), host_gib=64)
    base, ctx = problem(small_model(), the_cluster, workload())
    alone = tuple((d.name,) for d in the_cluster.devices)
    inst = tp_instance(base, ctx, alone)
    assert inst.devices == base.devices
    assert np.array_equal(inst.decode.unit_time_s, base.decode.unit_time_s)
    assert np.array_equal(inst.prefill.send_s, base.prefill.send_s)
