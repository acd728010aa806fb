"""The instance builder: wiring of cost model, cluster and workload into a PlanningInstance."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tessel.catalog import get_gpu, load_model
from tessel.cost import (
    DecodeFit,
    PrefillFit,
    Profile,
    embedding_bytes,
    hidden_bytes,
    kv_bytes_per_token,
    link_time_s,
    lm_head_bytes,
    profile_shape,
    unit_decode_time_s,
    unit_prefill_time_s,
    weight_bytes,
    workspace_bytes,
)
from tessel.errors import TesselError
from tessel.plan.build import build_instance, capacity_shortfall_bytes
from tessel.plan.files.cluster import load_cluster
from tessel.plan.files.workload import load_workload, parse_workload
from tessel.units import GIB


@pytest.fixture(scope="module")
def default_instance():
    return build_instance("llama-3-70b", "mixed-a100-v100-t4", "default")


def test_llama_3_70b_fits_the_default_cluster_with_room_for_kv(default_instance) -> None:
    inst = default_instance
    assert inst.n_units == 80 and inst.n_devices == 10
    workload = load_workload("default")
    m, b = workload.micro_batches, workload.micro_batch_size
    assert inst.micro_batches == m
    assert inst.kv_bytes[0] == 2 * 8 * 128 * 2 * m * b * workload.max_kv_tokens
    held = inst.weight_bytes.sum() + inst.kv_bytes.sum() + inst.first_bytes + inst.last_bytes
    held += inst.workspace_bytes.sum()  # every device's workspace: the fullest plan
    device_memory = sum(d.memory_bytes for d in inst.devices)
    assert held < device_memory  # fits on the GPUs alone, no offloading
    assert inst.kv_bytes.sum() > 40 * GIB  # ... with KV for every micro-batch in flight
    assert capacity_shortfall_bytes(inst) < 0


def test_device_slots_come_from_catalog_and_cluster(default_instance) -> None:
    cluster = load_cluster("mixed-a100-v100-t4")
    for slot, device in zip(default_instance.devices, cluster.devices, strict=True):
        spec = get_gpu(slot.gpu_type)
        assert (slot.name, slot.node) == (device.name, device.node)
        assert slot.memory_bytes == spec.memory_bytes - spec.reserved_bytes
        assert slot.host_bytes == cluster.host_bytes(device)
        assert slot.host_to_device_bytes_per_s == spec.pcie_h2d_bytes_per_s
    assert default_instance.devices[0].host_bytes == 256 * GIB  # 512 GiB over 2 GPUs


def test_unit_times_are_the_cost_model_at_the_workload_shape(default_instance) -> None:
    model, workload = load_model("llama-3-70b"), load_workload("default")
    b = workload.micro_batch_size
    for j, slot in enumerate(default_instance.devices):
        gpu = get_gpu(slot.gpu_type)
        prefill = unit_prefill_time_s(
            model, gpu, "layer", workload.prompt_tokens.mean_tokens, 0, batch_size=b
        )
        decode = unit_decode_time_s(model, gpu, "layer", b, b * workload.mean_decode_context_tokens)
        assert np.all(default_instance.prefill.unit_time_s[:, j] == prefill)
        assert np.all(default_instance.decode.unit_time_s[:, j] == decode)
    prefill = default_instance.prefill.unit_time_s[0]
    assert prefill[0] < prefill[2] < prefill[6]  # A100 < V100 < T4
    assert default_instance.decode_weight == workload.output_tokens.mean_tokens
    assert default_instance.prefill_weight == 1.0
    assert np.all(default_instance.prefill.first_time_s > 0) and np.all(
        default_instance.decode.last_time_s > 0
    )


def test_send_times_follow_links(default_instance) -> None:
    model, workload = load_model("llama-3-70b"), load_workload("default")
    cluster = load_cluster("mixed-a100-v100-t4")
    tokens = round(workload.micro_batch_size * workload.prompt_tokens.mean_tokens)
    send = default_instance.prefill.send_s
    assert np.all(np.diag(send) == 0)
    assert np.allclose(send, send.T)
    j, k = random.sample(range(10), 2)
    link = cluster.link(cluster.devices[j], cluster.devices[k])
    assert send[j, k] == pytest.approx(link_time_s(link, hidden_bytes(model, tokens)))
    assert send[0, 1] < send[0, 2]  # NVLink inside node-a beats Ethernet to node-b
    decode = default_instance.decode.send_s
    assert decode[0, 2] == pytest.approx(
        link_time_s(cluster.link("node-a/gpu0", "node-b/gpu0"), hidden_bytes(model, 7))
    )


def test_sublayer_units_split_the_layer() -> None:
    inst = build_instance("qwen2.5-7b", "llmpq-t4-v100", "long-prompt", granularity="sublayer")
    model = load_model("qwen2.5-7b")
    assert inst.n_units == 2 * model.num_layers
    assert [(u.layer, u.kind) for u in inst.units[:4]] == [
        (0, "attention"),
        (0, "mlp"),
        (1, "attention"),
        (1, "mlp"),
    ]
    assert inst.weight_bytes[0] + inst.weight_bytes[1] == weight_bytes(model, "layer", "fp16")
    assert np.all(inst.kv_bytes[1::2] == 0) and np.all(inst.kv_bytes[0::2] > 0)
    layer = build_instance(model, "llmpq-t4-v100", "long-prompt")
    blocks = inst.prefill.unit_time_s[0] + inst.prefill.unit_time_s[1]
    assert np.all(blocks >= layer.prefill.unit_time_s[0] * (1 - 1e-12))  # two kernels' max vs one
    assert inst.weight_bytes.sum() == layer.weight_bytes.sum()
    assert inst.labels["granularity"] == "sublayer"


def test_first_last_and_workspace_bytes() -> None:
    model = load_model("opt-30b")  # tied embeddings: the last stage still holds a copy
    workload = parse_workload(
        {
            "name": "w",
            "prompt_tokens": {"mean": 300, "max": 500},
            "output_tokens": 50,
            "batch_size": 6,
            "max_micro_batch": 3,
        }
    )
    inst = build_instance(model, "a100-8x80g", workload, dtype="int8", kv_dtype="int8")
    assert inst.first_bytes == embedding_bytes(model, "int8")
    assert inst.last_bytes == lm_head_bytes(model, "int8") + 2 * model.vocab_size * 4
    assert np.all(inst.workspace_bytes == workspace_bytes(model, 2 * 500))
    assert inst.kv_bytes[0] == kv_bytes_per_token(model, "int8") * 3 * 2 * 550
    assert inst.weight_bytes[0] == weight_bytes(model, "layer", "int8")


def test_capacity_shortfall() -> None:
    inst = build_instance("llama-3-70b", "local-cpu", "default")
    held = (
        inst.weight_bytes.sum()
        + inst.kv_bytes.sum()
        + inst.first_bytes
        + inst.last_bytes
        + inst.workspace_bytes.min()
    )
    capacity = sum(d.memory_bytes + d.host_bytes for d in inst.devices)
    assert capacity_shortfall_bytes(inst) == pytest.approx(held - capacity)
    assert capacity_shortfall_bytes(inst) > 0  # 2 CPUs with 62 GiB each, no host memory
    offload = build_instance("llama-3-70b", "t4-offload", "default")
    device_only = sum(d.memory_bytes for d in offload.devices)
    assert offload.weight_bytes.sum() > device_only  # needs the host ...
    assert capacity_shortfall_bytes(offload) < 0  # ... and fits with it


def test_profile_applies_to_its_device_type_only() -> None:
    model = load_model("llama-3-8b")
    profile = Profile(
        device_type="V100-32G",
        model_shape=profile_shape(model),
        dtype="fp16",
        prefill=PrefillFit(a0=1.0, a1=0.0, a2=0.0, a3=0.0),  # 1 s per layer: unmistakable
        decode=DecodeFit(b0=2.0, b1=0.0, b2=0.0),
        heldout_rel_error=0.0,
    )
    plain = build_instance(model, "mixed-a100-v100-t4", "default")
    profiled = build_instance(model, "mixed-a100-v100-t4", "default", profiles=[profile])
    v100 = [j for j, d in enumerate(profiled.devices) if d.gpu_type == "V100-32G"]
    others = [j for j, d in enumerate(profiled.devices) if d.gpu_type != "V100-32G"]
    assert np.all(profiled.prefill.unit_time_s[:, v100] == 1.0)
    assert np.all(profiled.decode.unit_time_s[:, v100] == 2.0)
    assert np.array_equal(profiled.prefill.unit_time_s[:, others], plain.prefill.unit_time_s[:, others])


def test_objects_and_overlap_and_labels() -> None:
    cluster, workload, model = (
        load_cluster("llmpq-v100-a100"),
        load_workload("offline-batch"),
        load_model("mistral-7b"),
    )
    inst = build_instance(model, cluster, workload, overlap=True)
    assert inst.overlap is True
    assert inst.labels == {
        "model": "mistral-7b", "cluster": "llmpq-v100-a100", "workload": "offline-batch",
        "granularity": "layer", "dtype": "fp16", "kv_dtype": "fp16",
    }  # fmt: skip


def test_helix_like_42_devices_build() -> None:
    inst = build_instance("llama-2-70b", "helix-like-42", "default", granularity="sublayer")
    assert inst.prefill.unit_time_s.shape == (160, 42)
    assert np.all(np.isfinite(inst.prefill.send_s)) and np.all(inst.decode.unit_time_s > 0)


def test_bad_options_are_user_errors() -> None:
    with pytest.raises(TesselError, match="granularity"):
        build_instance("llama-3-8b", "a100-8x80g", "default", granularity="token")
    with pytest.raises(TesselError, match="dtype"):
        build_instance("llama-3-8b", "a100-8x80g", "default", kv_dtype="fp12")
    with pytest.raises(TesselError, match="cluster"):
        build_instance("llama-3-8b", "nowhere", "default")
