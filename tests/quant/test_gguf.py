"""GGUF in: SmolLM2's GGUF (Q4_1 linears, Q8_0 embedding) and a Q8_0 re-quantisation of it.

Oracles: transformers' own GGUF loader (its de-quantised state dict, its logits); for Q8_0, the
`gguf` package's de-quantiser on the same blocks.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

from tessel import LLM, SamplingParams
from tessel.engine.scheduler import SchedulerOutput
from tessel.engine.sequence import Sequence
from tessel.errors import TesselError
from tessel.models import gguf as gguf_import

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def smollm2_gguf():
    import real_model

    try:
        return real_model.smollm2_gguf()
    except real_model.RealModelUnavailable as error:
        pytest.skip(f"SmolLM2 GGUF unavailable: {error}")


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "tessel-cache"))


def _logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    seq = Sequence("x", ids, SamplingParams(temperature=0), llm.config.block_size)
    llm.block_manager.allocate(seq, 0)
    return llm.runner.forward_logits(SchedulerOutput(prefills=[(seq, len(ids))]))


def test_q8_0_blocks_match_the_gguf_dequantiser(tmp_path) -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    values = (np.random.default_rng(0).standard_normal((6, 96)) * np.linspace(0.1, 5, 96)).astype(np.float32)
    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    blocks = quantize(values, GGMLQuantizationType.Q8_0)
    writer.add_tensor("w", blocks, raw_shape=blocks.shape, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tensor = gguf.GGUFReader(str(path)).tensors[0]
    q, scale = gguf_import.q8_0_blocks(tensor)
    expected = dequantize(tensor.data, GGMLQuantizationType.Q8_0)
    ours = (q.float().view(6, 3, 32) * scale.view(6, 3, 1)).view(6, 96)
    assert torch.equal(ours, torch.from_numpy(np.asarray(expected, dtype=np.float32)))


@pytest.mark.slow
def test_smollm2_gguf_loads_like_transformers_loads_it(smollm2_gguf, smollm2_dir) -> None:
    # smollm2_dir was built by transformers' GGUF loader from this very file
    ckpt = gguf_import.resolve_model_path(smollm2_gguf)
    ours = safe_open(str(ckpt / "model.safetensors"), "pt")
    ref = safe_open(str(smollm2_dir / "model.safetensors"), "pt")
    assert set(ours.keys()) == set(ref.keys())
    for name in ref.keys():
        assert torch.equal(ours.get_tensor(name), ref.get_tensor(name)), name
    llm = LLM(smollm2_gguf, max_model_len=64)
    text = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4))[0].text
    fp = LLM(smollm2_dir, max_model_len=64).generate(
        ["The capital of France is"], SamplingParams(temperature=0, max_tokens=4)
    )[0]
    assert text == fp.text


def _requantized_q8_0(src, dst) -> None:
    """SmolLM2's GGUF with every tensor of 2 dims re-quantised to Q8_0 (metadata copied)."""
    from gguf import GGMLQuantizationType, GGUFValueType
    from gguf.quants import dequantize, quantize

    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    for t in reader.tensors:
        values = dequantize(t.data, t.tensor_type).astype(np.float32)
        if values.ndim == 2:
            blocks = quantize(values, GGMLQuantizationType.Q8_0)
            writer.add_tensor(t.name, blocks, raw_shape=blocks.shape, raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(t.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow
def test_a_q8_0_gguf_keeps_int8_weights_and_matches_transformers(smollm2_gguf, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    q8 = tmp_path / "smollm2-q8_0.gguf"
    _requantized_q8_0(smollm2_gguf, q8)
    ckpt = gguf_import.resolve_model_path(q8)
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        assert "model.layers.0.self_attn.q_proj.weight_packed" in f.keys()
    llm = LLM(q8, max_model_len=64)
    ids = llm.tokenize("In the beginning God created the heaven and the earth.")
    got = _logits(llm, ids)
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=q8.name, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * float(expected.abs().max()))


def test_a_file_that_is_not_gguf_is_a_user_error(tmp_path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(TesselError, match="not a readable GGUF"):
        gguf_import.resolve_model_path(bad)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=st.binary(max_size=200), version=st.sampled_from([2, 3]))
def test_hostile_gguf_bytes_raise_only_tessel_error(tmp_path, body: bytes, version: int) -> None:
    path = tmp_path / "fuzz.gguf"
    path.write_bytes(b"GGUF" + version.to_bytes(4, "little") + body)
    try:
        gguf_import.hf_config(gguf_import._reader(path), False)
    except TesselError:
        pass
