"""The opt-in int8 LM head (`LLM(dir, lm_head="int8")`, `--lm-head int8`).

Oracles: the head alone against float64 `x @ (q * s).T` with q, s rounded here per row
(`round(w / (max|w| / 127))`), x fake-quantised per token for a W8A8 model; the engine's logits
against HF transformers' final hidden states (compressed-tensors checkpoints through
`ct_oracle.hf_quantized`) times that de-quantised head in float64. Bad modes: a TesselError /
exit code 2 naming the option, fuzzed.
"""

from __future__ import annotations

import typing

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from typer.testing import CliRunner

import tiny_models
from ct_oracle import fake_quant, hf_quantized
from tessel import LLM, SamplingParams
from tessel.cli import app
from tessel.commands.options import LMHeadMode
from tessel.engine.engine_config import EngineConfig
from tessel.engine.scheduler import SchedulerOutput
from tessel.engine.sequence import Sequence
from tessel.errors import TesselError
from tessel.kernels.cpu_features import ENV_OVERRIDE, W8A16_ENV_OVERRIDE
from tessel.layers.embedding import LMHead, QuantizedLMHead
from tessel.layers.linear import W8A8Linear, W8A16Linear
from tessel.models.quantized.lm_head import LM_HEAD_MODES, check_lm_head_mode, quantize_lm_head
from tessel.models.quantized.schemes import make_scheme

SCHEMES = {"float": None, "w8a16": make_scheme("w8a16"), "w8a8": make_scheme("w8a8")}


def oracle_head(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row symmetric int8 [-127, 127] by max|w| / 127, float64."""
    w = weight.double()
    scale = w.abs().amax(dim=1).clamp(min=1e-30) / 127
    return torch.round(w / scale[:, None]).clamp(-127, 127), scale


def check_codes(linear: nn.Module, weight: torch.Tensor) -> None:
    """The head's int8 codes and scales are the oracle's; a code may differ by one only where
    w / s sits on a rounding tie (float32 vs float64 division)."""
    q, scale = oracle_head(weight)
    live = weight.abs().amax(dim=1) > 0  # a row of zeros (a padding token's) has codes 0, any scale
    torch.testing.assert_close(linear.weight_scale.double()[live], scale[live], rtol=1e-6, atol=0)
    ratio = weight.double() / scale[:, None]
    off = linear.weight.double() != q
    assert (linear.weight.double() - q).abs().max() <= 1
    assert ((ratio[off].abs() % 1 - 0.5).abs() < 1e-5).all()


def oracle_logits(hidden: torch.Tensor, linear: nn.Module, int8_acts: bool) -> torch.Tensor:
    """float64 hidden (fake-quantised per token for W8A8) @ the de-quantised head."""
    x = fake_quant(hidden.double(), None) if int8_acts else hidden.double()
    return x @ (linear.weight.double() * linear.weight_scale.double()[:, None]).T


def _head(v: int, k: int, seed: int) -> LMHead:
    head = LMHead(v, k)
    head.weight.data = torch.randn(v, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    return head


@pytest.mark.parametrize(
    ("scheme", "path"),
    [("float", "gemv"), ("float", "dequant"), ("w8a16", "gemv"), ("w8a8", "int_mm"), ("w8a8", "dequant")],
)
@pytest.mark.parametrize(("m", "v", "k"), [(1, 389, 70), (3, 389, 70), (33, 1001, 64), (1, 257, 96)])
def test_head_matches_float64(monkeypatch, scheme: str, path: str, m: int, v: int, k: int) -> None:
    monkeypatch.setenv(ENV_OVERRIDE if scheme == "w8a8" else W8A16_ENV_OVERRIDE, path)
    head = _head(v, k, seed=v + k)
    module = quantize_lm_head(head, SCHEMES[scheme], torch.float32, "cpu")
    linear = module.linear
    assert isinstance(linear, W8A8Linear if scheme == "w8a8" else W8A16Linear)
    assert linear.path == path
    check_codes(linear, head.weight)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = module(x)
    assert got.dtype == torch.float32 and got.shape == (m, v)
    torch.testing.assert_close(got.double(), oracle_logits(x, linear, scheme == "w8a8"), rtol=1e-5, atol=1e-5)


def test_other_dtypes_run_the_dequantised_rows() -> None:
    head = _head(300, 48, seed=1)
    module = quantize_lm_head(head, None, torch.bfloat16, "cpu")
    assert isinstance(module.linear, nn.Linear) and module.linear.weight.dtype == torch.bfloat16
    q, scale = oracle_head(head.weight)
    torch.testing.assert_close(
        module.linear.weight.double(), (q * scale[:, None]).bfloat16().double(), atol=0, rtol=2**-7
    )
    assert module(torch.randn(2, 48, dtype=torch.bfloat16)).dtype == torch.float32


def _prefill_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    seq = Sequence("x", ids, SamplingParams(temperature=0), block_size=8)
    llm.block_manager.allocate(seq, 0)
    logits = llm.runner.forward_logits(SchedulerOutput(prefills=[(seq, len(ids))]))
    llm.block_manager.free(seq)
    return logits


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_llama) -> dict[str, object]:
    """fp32 untied (tiny_llama), fp32 tied, and tiny_llama quantised to w8a16 / w8a8."""
    root = tmp_path_factory.mktemp("lm_head")
    found = {"float": tiny_llama, "float tied": tiny_models.variant_checkpoint(root, "llama31_tied")}
    for scheme in ("w8a16", "w8a8"):
        out = root / scheme
        result = CliRunner().invoke(app, ["quantize", str(tiny_llama), "--out", str(out), "--scheme", scheme])
        assert result.exit_code == 0, result.output
        found[scheme] = out
    return found


@pytest.mark.parametrize("name", ["float", "float tied", "w8a16", "w8a8"])
def test_engine_logits_match_hf_with_the_int8_head(checkpoints, name: str) -> None:
    path = checkpoints[name]
    llm = LLM(path, max_model_len=64, block_size=8, lm_head="int8")
    assert isinstance(llm.model.lm_head, QuantizedLMHead)
    hf = hf_quantized(path) if name in ("w8a16", "w8a8") else _hf_float(path)
    ids = torch.randint(4, 300, (13,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        hidden = hf.model(torch.tensor([ids])).last_hidden_state[0]
    check_codes(llm.model.lm_head.linear, hf.lm_head.weight)
    want = oracle_logits(hidden, llm.model.lm_head.linear, name == "w8a8")
    torch.testing.assert_close(_prefill_logits(llm, ids).double(), want, rtol=1e-4, atol=2e-4)
    embed = hf.model.embed_tokens.weight
    assert torch.equal(llm.model.model.embed_tokens.weight, embed)  # the lookup stays float


def _hf_float(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def test_w8a16_decode_takes_the_gemv_and_matches_the_oracle(checkpoints, monkeypatch) -> None:
    """One-row decode steps through the head's compiled GEMV: HF's greedy tokens and logprobs."""
    monkeypatch.setenv(W8A16_ENV_OVERRIDE, "gemv")
    path = checkpoints["w8a16"]
    llm = LLM(path, max_model_len=64, block_size=8, lm_head="int8")
    assert llm.model.lm_head.linear.path == "gemv"
    prompt = torch.randint(4, 300, (11,), generator=torch.Generator().manual_seed(5)).tolist()
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    got = llm.generate([prompt], params, use_progress=False)[0]
    hf = hf_quantized(path)
    with torch.no_grad():
        hidden = hf.model(torch.tensor([prompt + got.token_ids])).last_hidden_state[0]
    check_codes(llm.model.lm_head.linear, hf.lm_head.weight)
    logprobs = oracle_logits(hidden, llm.model.lm_head.linear, False)[len(prompt) - 1 : -1].log_softmax(-1)
    assert got.token_ids == logprobs.argmax(-1).tolist()
    chosen = logprobs.gather(1, torch.tensor(got.token_ids)[:, None])[:, 0]
    engine = torch.tensor([lp.logprob for lp in got.logprobs], dtype=torch.float64)
    torch.testing.assert_close(engine, chosen, atol=1e-4, rtol=1e-4)


def test_default_head_stays_float(checkpoints) -> None:
    llm = LLM(checkpoints["w8a16"], max_model_len=64, block_size=8)
    assert not isinstance(llm.model.lm_head, QuantizedLMHead)


def test_cli_modes_are_the_engine_modes() -> None:
    assert typing.get_args(LMHeadMode) == LM_HEAD_MODES


@settings(max_examples=200, deadline=None)
@given(mode=st.one_of(st.text(max_size=12), st.sampled_from(["INT8", "int4", "fp8", " int8"]), st.none(),
                      st.integers(), st.floats()))  # fmt: skip
def test_bad_modes_raise_tessel_error(mode) -> None:
    if mode in LM_HEAD_MODES:
        assert check_lm_head_mode(mode) == mode
        return
    with pytest.raises(TesselError, match="lm_head must be one of float, int8"):
        EngineConfig(lm_head=mode)


def test_cli_refuses_bad_modes(tiny_llama, tmp_path) -> None:
    runner = CliRunner()
    for command in ("generate", "serve"):
        args = [command, "--model", str(tiny_llama), "--lm-head", "int4"]
        result = runner.invoke(app, args + (["--prompt", "hi"] if command == "generate" else []))
        assert result.exit_code == 2, result.output
        assert "--lm-head" in result.output
    plan = ["serve", "--model", str(tiny_llama), "--lm-head", "int8", "--plan", str(tmp_path / "plan.json")]
    result = runner.invoke(app, plan)  # a TesselError: `tessel` prints it and exits 2
    assert isinstance(result.exception, TesselError) and "--plan" in str(result.exception), result.output


def test_cli_generate_with_the_int8_head(tiny_llama) -> None:
    args = ["generate", "--model", str(tiny_llama), "--prompt", "hello", "--max-tokens", "3"]
    result = CliRunner().invoke(app, [*args, "--lm-head", "int8"])
    assert result.exit_code == 0, result.output
    assert "3 tokens" in result.output
