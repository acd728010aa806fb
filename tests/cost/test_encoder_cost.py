"""Encoders (BERT) in the cost model and the planner.

Oracles: parameter and FLOP counts of bert-base worked out by hand below (and HF's published
parameter count of bert-base-uncased, 109,482,240 with the pooler); torch's FLOP counter over the
engine's own BERT encoder (tessel.models.bert) with random weights; the real all-MiniLM-L6-v2
config.json for the preset.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode
from typer.testing import CliRunner

from tessel.catalog.bert_config import BertConfig
from tessel.catalog.models import PRESETS, load_model, spec_from_bert
from tessel.cli import app
from tessel.cost import layer as L
from tessel.cost.roofline import unit_decode_time_s, unit_prefill_time_s
from tessel.plan.build import build_instance
from tessel.plan.files.cluster import load_cluster

H, F, LAYERS, VOCAB, POSITIONS, TYPES = 768, 3072, 12, 30522, 512, 2


def test_bert_base_parameters_by_hand() -> None:
    model = load_model("bert-base-uncased")
    assert model.encoder and (model.mlp_kind, model.norm_kind) == ("plain", "layernorm")
    attention = 4 * H * H + 4 * H + 2 * H  # q, k, v, o weights and biases; its LayerNorm (gain, bias)
    mlp = 2 * H * F + F + H + 2 * H  # fc1, fc2 weights and biases; its LayerNorm
    assert L.layer_params(model) == attention + mlp == 7_087_872
    embeddings = (VOCAB + POSITIONS + TYPES) * H + 2 * H  # word, position, token type; LayerNorm
    assert L.total_params(model) == LAYERS * 7_087_872 + embeddings == 108_891_648
    pooler = H * H + H  # BertModel's pooler, which sentence-transformers does not run
    assert L.total_params(model) + pooler == 109_482_240  # HF's count for bert-base-uncased
    assert L.embedding_bytes(model, "fp16") == 2 * embeddings and L.lm_head_bytes(model, "fp16") == 0
    assert L.kv_bytes_per_token(model) == 0  # nothing cached


def test_bert_base_forward_flops_by_hand() -> None:
    model = load_model("bert-base-uncased")
    n = 128
    gemms = 2 * n * (4 * H * H + 2 * H * F)  # 2 FLOPs per multiply-add over every weight
    attention = 2 * (2 * n * n * H)  # QK^T and PV over all 12 heads of 64: n*n*768 MACs each
    assert L.encoder_forward_flops(model, n) == LAYERS * (gemms + attention) == 22_347_251_712
    # a causal decoder of the same shape attends over half the pairs (plus the diagonal)
    assert L.query_key_pairs(model, n, 0) == n * n
    decoder = load_model("opt-30b")
    assert L.query_key_pairs(decoder, n, 0) == L.prefill_query_key_pairs(n, 0) == n * n / 2


def test_flops_equal_torch_flop_counter_on_the_engines_encoder() -> None:
    config = dict(PRESETS["all-minilm-l6-v2"][1], num_hidden_layers=2, vocab_size=1000)  # a small table
    bert = BertConfig.from_dict(config)
    torch.manual_seed(0)
    from tessel.models.bert import BertEncoder

    encoder = BertEncoder(bert).eval()
    batch, n = 3, 40
    ids = torch.randint(0, bert.vocab_size, (batch, n))
    # the math backend runs attention as batched matmuls, which the counter sees
    with torch.inference_mode(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        encoder(ids, torch.ones_like(ids))
    model = spec_from_bert(bert, name="minilm-2", source="preset")
    assert counter.get_total_flops() == batch * L.encoder_forward_flops(model, n)


def test_the_minilm_preset_is_the_real_config(tmp_path: Path) -> None:
    from tests.encoder_models import minilm_dir

    real = load_model(minilm_dir())
    preset = load_model("all-minilm-l6-v2")
    for field in ("num_layers", "hidden_size", "num_heads", "head_dim", "intermediate_size", "vocab_size"):
        assert getattr(real, field) == getattr(preset, field), field
    assert real.encoder and real.learned_position_rows == preset.learned_position_rows == 514


def test_encoder_units_have_no_kv_and_no_decode() -> None:
    model, cluster = load_model("bert-base-uncased"), load_cluster("local-cpu")
    gpu = cluster.devices[0].spec
    prefill = unit_prefill_time_s(model, gpu, "layer", 128, 0, batch_size=4)
    assert prefill > 0
    instance = build_instance(model, cluster, "default")
    assert not instance.kv_bytes.any() and getattr(instance, "kv_restore", None) is None  # no KV to restore
    assert not instance.decode.unit_time_s.any() and not instance.decode.send_s.any()
    assert instance.decode_weight == 1.0  # one output (its embedding) per request
    assert unit_decode_time_s(model, gpu, "layer", 1, 1) >= 0  # defined, but the planner never charges it


def test_plan_an_encoder_from_a_preset_and_a_directory(tmp_path: Path) -> None:
    folder = tmp_path / "minilm"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(PRESETS["all-minilm-l6-v2"][1]))
    runner = CliRunner()
    for model in ("bert-base-uncased", str(folder)):
        out = tmp_path / f"{Path(model).name}.json"
        result = runner.invoke(app, ["plan", "--model", model, "--cluster", "local-cpu", "--json", str(out)])
        assert result.exit_code == 0, result.output
        said = " ".join(result.output.split())
        assert "predicted (encoder, one forward per request)" in said and "sequences/s" in said
        assert "prompts truncated at 512" in said  # the chat workload's prompts run to 2048 tokens
        plan = json.loads(out.read_text())
        assert plan["stages"] and all(stage["kv_gib"] == 0 for stage in plan["stages"])
        simulated = runner.invoke(app, ["simulate", "--plan", str(out)])
        assert simulated.exit_code != 0  # no decode steps to simulate: refused, not decoded
        assert "is an encoder" in str(simulated.exception)


@pytest.mark.parametrize("n", [1, 7, 512])
def test_an_encoder_layer_costs_more_attention_than_a_causal_one(n: int) -> None:
    model = load_model("bert-base-uncased")
    attention = L.attention_core_flops(model, "attention", L.query_key_pairs(model, n, 0))
    assert attention == 4 * H * n * n
