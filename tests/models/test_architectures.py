"""Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, Phi-3, Gemma 3 and Mistral's sliding window against HF
transformers, on tiny random checkpoints built with transformers' own config classes.

Oracles: greedy tokens equal `generate` for 32 new tokens on several prompts (one process, and two
pipeline stages in one process through the stage runtime's loopback); logits of a prefill, a chunk
on its cached prefix and single-token decodes within 1e-4 of HF's forward over 40 tokens, longer
than Mistral's and Gemma 3's windows.
"""

from __future__ import annotations

import pytest
import torch

from hf_oracle import TEXTS, assert_matches_hf, hf_model
from loopback_stage import two_stages
from tessel import LLM, SamplingParams
from tessel.engine.scheduler import SchedulerOutput
from tessel.engine.sequence import Sequence

NEW = ["qwen3", "qwen3_tied", "mixtral", "qwen2_moe", "qwen3_moe", "phi3", "gemma3", "mistral_window"]
GREEDY_32 = SamplingParams(temperature=0.0, max_tokens=32)
LONG = "The cat sat on the mat. The dog sat on the log. The bird sang in the tree, and the sun was warm."


@pytest.mark.parametrize("variant", NEW)
def test_greedy_tokens_match_hf_generate(checkpoints, variant: str) -> None:
    path = checkpoints(variant)
    llm = LLM(path, max_model_len=256, block_size=8)
    outputs = llm.generate([*TEXTS, LONG], GREEDY_32, use_progress=False)
    assert_matches_hf(path, outputs, max_new_tokens=32)
    assert llm.num_free_blocks == llm.num_total_blocks


@pytest.mark.parametrize("variant", NEW)
def test_logits_match_hf_forward_in_prefill_chunks_and_decode(checkpoints, variant: str) -> None:
    """Prefill 20 tokens, a 15-token chunk on that cached prefix, then 5 single-token decodes."""
    path = checkpoints(variant)
    llm = LLM(path, max_model_len=128, block_size=8)
    ids = torch.randint(4, llm.model_config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(path)(ids[None]).logits[0].float()
    seq = Sequence("x", ids.tolist(), GREEDY_32, block_size=8)
    llm.block_manager.allocate(seq, 0)
    got = []
    for n in (20, 15, 1, 1, 1, 1, 1):
        batch = SchedulerOutput(decodes=[seq]) if n == 1 else SchedulerOutput(prefills=[(seq, n)])
        got.append(llm.runner.forward_logits(batch))
        seq.num_computed_tokens += n
    scale = float(expected.abs().max())
    torch.testing.assert_close(torch.cat(got), expected, rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("variant", ["qwen3", "mixtral", "qwen2_moe", "phi3", "gemma3", "mistral_window"])
def test_two_pipeline_stages_match_hf_generate(checkpoints, tmp_path, monkeypatch, variant: str) -> None:
    path = checkpoints(variant)
    layers = int(tiny_read(path)["num_hidden_layers"])
    engine, _ = two_stages(path, tmp_path, monkeypatch, slots=2, splits=((0, 1), (1, layers)))
    outputs = engine.generate([*TEXTS[:3], LONG], GREEDY_32, use_progress=False)
    assert_matches_hf(path, outputs, max_new_tokens=32)


def tiny_read(path):
    from tiny_models import read_config

    return read_config(path)


REFUSED = [
    ("qwen3", {"architectures": ["FooForCausalLM"]}, "'FooForCausalLM' is not supported"),
    ("mixtral", {"num_local_experts": 0}, "'num_local_experts'"),
    ("mixtral", {"num_local_experts": 10**6}, "'num_local_experts'"),
    ("qwen3_moe", {"num_experts": 0}, "'num_experts'"),
    ("qwen2_moe", {"num_experts": 10**6}, "'num_experts'"),
    ("qwen2_moe", {"num_experts_per_tok": 5}, "num_experts_per_tok \\(5\\) exceeds num_experts \\(4\\)"),
    ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok \\(9\\) exceeds num_local_experts"),
    ("qwen2_moe", {"mlp_only_layers": [7]}, "'mlp_only_layers'"),
    ("mistral_window", {"sliding_window": 0}, "'sliding_window'"),
    ("mistral_window", {"sliding_window": -4}, "'sliding_window'"),
    ("gemma3", {"sliding_window": 0}, "'sliding_window'"),
    ("gemma3", {"layer_types": ["sliding_attention", "full_attention"]}, "'layer_types' lists 2 layers"),
    ("gemma3", {"layer_types": ["sliding_attention", "global", "full_attention"]}, "'layer_types'"),
    ("gemma3", {"final_logit_softcapping": 30.0}, "'final_logit_softcapping'"),
    ("phi3", {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}}, "partial_rotary"),
]


@pytest.mark.parametrize(("variant", "changes", "message"), REFUSED)
def test_bad_configs_are_refused_at_read_naming_the_field(checkpoints, tmp_path, variant, changes, message):
    import json
    import shutil

    from tessel.errors import TesselError
    from tessel.models.reader import read_model

    path = tmp_path / variant
    shutil.copytree(checkpoints(variant), path)
    config = json.loads((path / "config.json").read_text()) | changes
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(TesselError, match=message):
        read_model(path)


def test_the_cli_refuses_an_unknown_architecture_with_exit_2_listing_the_runnable(checkpoints, tmp_path):
    import json
    import shutil

    from typer.testing import CliRunner

    from tessel.cli import app
    from tessel.errors import TesselError

    path = tmp_path / "foo"
    shutil.copytree(checkpoints("qwen3"), path)
    config = json.loads((path / "config.json").read_text()) | {"architectures": ["FooForCausalLM"]}
    (path / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(app, ["generate", "--model", str(path), "--prompt", "hi"])
    assert isinstance(result.exception, TesselError) and result.exception.exit_code == 2
    message = str(result.exception)
    assert "FooForCausalLM" in message and "Gemma3ForCausalLM" in message and "--runnable" in message


def test_the_quantiser_maps_every_runnable_architecture(checkpoints) -> None:
    from tessel.catalog.hf_arch import RUNNABLE_ARCHITECTURES
    from tessel.models.reader import QUANTISED_ARCHITECTURES
    from tessel.quant.calibrate import read_model_config

    assert set(QUANTISED_ARCHITECTURES) == set(RUNNABLE_ARCHITECTURES)
    assert read_model_config(checkpoints("mixtral"))["architectures"] == ["MixtralForCausalLM"]


@pytest.mark.parametrize("q8_0", [False, True])
@pytest.mark.parametrize(
    "variant", ["qwen2", "qwen3", "gemma3_llamacpp", "mixtral", "qwen2_moe", "qwen3_moe"]
)
def test_a_gguf_of_the_new_architectures_reads_back_to_the_checkpoints_logits(
    checkpoints, tmp_path, variant, q8_0
):
    """The tiny checkpoint written as llama.cpp's converter would (Gemma's norms as 1 + w), float32 or
    its linears Q8_0 (de-quantised on read with gguf's own de-quantiser), read back: the logits are
    HF's on the original checkpoint (float32: to 1e-4; Q8_0: within its rounding, the same argmax
    almost everywhere)."""
    import shutil

    from tessel.models.gguf import _reader, write_weights
    from tiny_gguf import write_tiny_gguf

    source = checkpoints(variant)
    file = write_tiny_gguf(source, tmp_path / f"{variant}.gguf", q8_0=q8_0)
    out = tmp_path / "converted"
    out.mkdir()
    write_weights(_reader(file), out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    llm = LLM(out, max_model_len=64)
    ids = torch.randint(4, llm.model_config.vocab_size, (24,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = hf_model(source)(ids[None]).logits[0].float()
    seq = Sequence("x", ids.tolist(), GREEDY_32, block_size=16)
    llm.block_manager.allocate(seq, 0)
    got = llm.runner.forward_logits(SchedulerOutput(prefills=[(seq, 24)]))
    scale = float(expected.abs().max())
    if not q8_0:
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * scale)
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.8


def test_list_models_runnable_names_every_architecture_the_engine_runs() -> None:
    from typer.testing import CliRunner

    from tessel.cli import app
    from tessel.models.config import SUPPORTED_ARCHITECTURES

    result = CliRunner().invoke(app, ["list", "models", "--runnable"])
    assert result.exit_code == 0 and result.output.split() == list(SUPPORTED_ARCHITECTURES)


@pytest.mark.parametrize(
    ("variant", "changes", "message"),
    [
        (
            "qwen3",
            {"intermediate_size": 136},
            r"'blk\.0\.ffn_(gate|up|down)\.weight' has shape .*intermediate_size",
        ),
        (
            "qwen2",
            {"num_key_value_heads": 4},
            r"'blk\.0\.attn_k\.(weight|bias)' has shape .*num_key_value_heads",
        ),
        (
            "mixtral",
            {"num_local_experts": 3},
            r"'blk\.0\.ffn_gate_inp\.weight' has shape \[4, 64\].*\[3, 64\] \(num_experts",
        ),
        ("gemma3", {"head_dim": 16}, r"'blk\.0\.attn_\w+\.weight' has shape .*head_dim"),
    ],
)
def test_a_gguf_whose_tensors_disagree_with_its_metadata_is_refused_before_reading_them(
    checkpoints, tmp_path, monkeypatch, variant, changes, message, retype=None
):
    """The metadata is written from an edited config.json, the tensors from the unedited weights: the
    tensors' shapes in the file's header are held against what the metadata implies before any
    tensor is de-quantised (the de-quantiser is made to fail, so a refusal after it would show)."""
    import json
    import shutil

    from tessel.errors import TesselError
    from tessel.models import gguf
    from tessel.models.reader import read_model
    from tiny_gguf import write_tiny_gguf

    source = tmp_path / "source"
    shutil.copytree(checkpoints(variant), source)
    config = json.loads((source / "config.json").read_text()) | changes
    (source / "config.json").write_text(json.dumps(config))
    file = write_tiny_gguf(source, tmp_path / f"{variant}.gguf", retype=retype)
    monkeypatch.setenv("TESSEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf, "_dequantized", lambda tensor: pytest.fail("a tensor was read"))
    with pytest.raises(TesselError, match=message):
        read_model(file)


@pytest.mark.parametrize("dtype", ["int32", "float64"])
def test_a_gguf_tensor_of_a_type_tessel_cannot_read_is_refused_before_reading_it(
    checkpoints, tmp_path, monkeypatch, dtype
):
    test_a_gguf_whose_tensors_disagree_with_its_metadata_is_refused_before_reading_them(
        checkpoints,
        tmp_path,
        monkeypatch,
        "qwen3",
        {},
        rf"GGUF tensor 'blk\.1\.attn_q\.weight' is stored as {'I32' if dtype == 'int32' else 'F64'}",
        retype={"blk.1.attn_q.weight": dtype},
    )
