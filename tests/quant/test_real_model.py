"""SmolLM2-135M-Instruct (a real trained model): `tessel quantize` then the engine on held-out text.

A short smoke of what benchmarks/quant.py measures in full: W8A8 (dynamic, round to nearest) and
W8A16 keep the perplexity of 255 held-out tokens close to fp32's, through the engine.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tessel import LLM, SamplingParams
from tessel.engine.scheduler import SchedulerOutput
from tessel.engine.sequence import Sequence
from tessel.quant.calibrate import QuantizeOptions, quantize_model

EVAL = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "kjv_evaluation.txt"
TOKENS = 256


def _perplexity(path: Path) -> float:
    llm = LLM(path, max_model_len=TOKENS)
    ids = llm.tokenizer(EVAL.read_text(encoding="utf-8"))["input_ids"][:TOKENS]
    seq = Sequence("ppl", ids, SamplingParams(temperature=0), llm.config.block_size)
    llm.block_manager.allocate(seq, 0)
    logits = llm.runner.forward_logits(SchedulerOutput(prefills=[(seq, len(ids))])).double()
    return math.exp(float(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))))


@pytest.mark.slow
@pytest.mark.parametrize(("scheme", "limit_pct"), [("w8a8", 6.0), ("w8a16", 2.0)])
def test_quantised_smollm2_keeps_its_perplexity(smollm2_dir, tmp_path, scheme: str, limit_pct: float) -> None:
    out = quantize_model(smollm2_dir, tmp_path / scheme, QuantizeOptions(scheme=scheme)).out_dir
    base, quantised = _perplexity(smollm2_dir), _perplexity(out)
    assert base < 40  # a trained model on English text
    assert quantised != base
    assert 100 * (quantised / base - 1) < limit_pct, (base, quantised)
