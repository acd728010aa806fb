"""Quantised checkpoints on a CUDA GPU: W8A8 through Triton's int8 GEMM (`tessel.kernels.int8_gemm`),
W8A16 through the in-kernel de-quantising GEMM (`w8a16_gemm`), W4A16 de-quantised at load.

Oracle: HF transformers + compressed-tensors on the CPU (`ct_oracle.hf_quantized`, W8A8 inputs
fake-quantised as the int8 GEMM computes them). Skipped where PyTorch sees no GPU; run there with
TRITON_INTERPRET=0.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from ct_oracle import hf_quantized
from decode_steps import decode_logits
from tessel import LLM
from tessel.cli import app
from tessel.layers.linear import W8A8Linear, W8A16Linear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CASES = {
    "w8a8": (["--scheme", "w8a8"], W8A8Linear),
    "w8a8-static": (["--scheme", "w8a8", "--act", "static", "--observer", "mse"], W8A8Linear),
    "w8a16": (["--scheme", "w8a16"], W8A16Linear),
    "w4a16-g32": (["--scheme", "w4a16", "--group-size", "32"], torch.nn.Linear),
}


@pytest.fixture(scope="module")
def quantized(tiny_llama, calib_text, tmp_path_factory):
    made = {}

    def get(case: str):
        if case not in made:
            out = tmp_path_factory.mktemp("cuda-quant") / case
            args = ["quantize", str(tiny_llama), "--out", str(out), "--calib", str(calib_text)]
            args += ["--calib-samples", "4", "--seq-len", "32", *CASES[case][0]]
            result = CliRunner().invoke(app, args)
            assert result.exit_code == 0, result.output + repr(result.exception)
            made[case] = out
        return made[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_quantized_checkpoint_on_cuda_matches_the_compressed_tensors_oracle(quantized, case: str) -> None:
    path = quantized(case)
    llm = LLM(path, device="cuda", max_model_len=128, block_size=8)
    kinds = {type(m) for m in llm.model.model.layers.modules()}
    assert CASES[case][1] in kinds
    assert all(p.is_cuda for p in llm.model.state_dict().values())
    ids = torch.randint(4, 300, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    got, _ = decode_logits(llm, ids, prefill=24)  # a prefill, then 16 single decode steps
    assert llm.runner.cuda_graphs.replays == 16  # as captured CUDA graphs
    with torch.no_grad():
        expected = hf_quantized(path)(torch.tensor([ids])).logits[0]
    got, scale = got.float().cpu(), float(expected.abs().max())
    if "w8a8" in case:
        # an activation on a rounding tie may round the other way (float sums in a different order),
        # and the K/V it writes stays in the cache: most rows match tightly, all stay near
        rows_close = (got - expected).abs().amax(dim=1) <= 2e-3 * scale
        assert float(rows_close.float().mean()) >= 0.9, rows_close
        assert float((got - expected).norm() / expected.norm()) < 2e-2
    else:
        torch.testing.assert_close(got, expected, rtol=2e-4, atol=2e-4 * scale)


def test_int8_lm_head_on_cuda_stays_near_the_float_head(quantized) -> None:
    path = quantized("w8a8")
    ids = torch.randint(4, 300, (30,), generator=torch.Generator().manual_seed(3)).tolist()
    head, _ = decode_logits(LLM(path, device="cuda", max_model_len=64, lm_head="int8"), ids, prefill=30)
    float_head, _ = decode_logits(LLM(path, device="cuda", max_model_len=64), ids, prefill=30)
    assert float((head - float_head).abs().max()) > 0
    relative = float((head - float_head).norm() / float_head.norm())
    assert relative < 0.02, relative


def test_half_precision_w8a8_and_w8a16_on_cuda(quantized) -> None:
    """float16 activations (the GPU's usual dtype): near the float32 oracle."""
    ids = torch.randint(4, 300, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    for case in ("w8a8", "w8a16"):
        path = quantized(case)
        got, _ = decode_logits(
            LLM(path, device="cuda", dtype=torch.float16, max_model_len=64), ids, prefill=20
        )
        with torch.no_grad():
            expected = hf_quantized(path)(torch.tensor([ids])).logits[0]
        relative = float((got.float().cpu() - expected).norm() / expected.norm())
        # float16 rows round before the per-token quantiser: some int8 codes move by one
        assert relative < (5e-2 if case == "w8a8" else 1e-2), (case, relative)
