"""The step's tokens applied in bulk (`LLMEngine._apply_tokens`, issue 47) against the per-request
path (`_apply_token`: `_append` then `_output`, the oracle) on a fresh engine of each: the same
outputs step by step (tokens, texts and deltas, finish reasons, logprobs) over random requests with
EOS, stop token ids, stop strings, max_tokens, max_model_len, sampling, logprobs, prompt logprobs,
aborts and preemptions, read as a server reads them (every output) or as `generate` does (the last)."""

from __future__ import annotations

import random

import pytest

from random_requests import random_params
from tessel import LLM, SamplingParams

FIELDS = (
    "request_id", "prompt_token_ids", "token_ids", "new_token_ids", "text", "new_text", "finished",
    "finish_reason", "num_prompt_tokens", "num_output_tokens", "prompt", "error", "logprobs",
    "prompt_logprobs",
)  # fmt: skip


def engine(checkpoints, bulk: bool) -> LLM:
    # few KV blocks: some steps preempt
    llm = LLM(checkpoints("llama"), max_model_len=64, block_size=4, num_kv_blocks=48, max_num_seqs=8)
    llm.bulk = bulk
    return llm


@pytest.fixture(scope="module")
def engines(checkpoints) -> tuple[LLM, LLM]:
    return engine(checkpoints, True), engine(checkpoints, False)


def run(llm: LLM, seed: int) -> list[list[tuple]]:
    """Random requests stepped to the end, two still running aborted midway; -> each step's outputs'
    fields (metrics as which times are set), the streamed requests' read as they come, the others'
    after the run."""
    rng = random.Random(seed)
    streamed = set()
    for i in range(12):
        rid = f"bulk-{seed}-{i}"
        prompt = [rng.randrange(5, 300) for _ in range(rng.randint(1, 12))]
        llm.add_request(rid, prompt, random_params(rng, i))
        if rng.random() < 0.5:
            streamed.add(rid)
    steps, read = [], {}
    while llm.has_unfinished_requests():
        outputs = llm.step()
        for out in outputs:
            if out.request_id in streamed:
                read[id(out)] = fields(out)
        steps.append(outputs)
        running = sorted(llm._requests)
        if len(steps) in (2, 5) and running:
            llm.abort_request(running[len(steps) % len(running)])
    return [[read.get(id(out)) or fields(out) for out in outputs] for outputs in steps]


def fields(out) -> tuple:
    m = out.metrics
    times = tuple(t is not None for t in (m.first_scheduled_time, m.first_token_time, m.finish_time))
    return (*(getattr(out, name) for name in FIELDS), times, m.num_cached_tokens)


@pytest.mark.parametrize("seed", range(4))
def test_the_bulk_path_gives_the_per_request_outputs(engines, seed):
    bulk, per_request = engines
    found = run(bulk, seed)
    assert found == run(per_request, seed)
    finished = [out for outputs in found for out in outputs if out[FIELDS.index("finished")]]
    assert len(finished) == 12
    reasons = {out[FIELDS.index("finish_reason")] for out in finished}
    assert {"length", "abort"} <= reasons, reasons


def test_the_bulk_path_stops_on_eos_and_stop_tokens(engines):
    """A greedy request's third token made its EOS, then its stop token id: both paths stop it there
    ("stop", the token kept), and with ignore_eos neither stops at EOS."""
    bulk, per_request = engines
    prompt = [7, 8, 9, 10]
    free = bulk.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))[0]
    third = free.token_ids[2]
    if third in free.token_ids[:2]:
        pytest.skip("the third token also comes earlier")
    stop_at_third = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, stop_token_ids=[third])
    cases = {
        "eos": (SamplingParams(temperature=0, max_tokens=6), frozenset({third})),
        "ignore_eos": (SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), frozenset({third})),
        "stop_token_ids": (stop_at_third, None),
    }
    for name, (params, eos) in cases.items():
        runs = [run_one(llm, prompt, params, eos) for llm in (bulk, per_request)]
        assert runs[0] == runs[1], name
        last = runs[0][-1]
        ids, reason = last[FIELDS.index("token_ids") - 2], last[FIELDS.index("finish_reason") - 2]
        if name == "ignore_eos":
            assert ids == free.token_ids and reason == "length"
        else:
            assert ids == free.token_ids[:3] and reason == "stop", name


def run_one(llm: LLM, prompt: list[int], params: SamplingParams, eos: frozenset | None) -> list[tuple]:
    """The request stepped to the end (with `eos` as the engine's EOS ids, when given); -> its outputs'
    fields after the request id and prompt."""
    kept = llm.eos_token_ids
    if eos is not None:
        llm.eos_token_ids = eos
    found: list[tuple] = []
    try:
        llm.add_request(f"one-{id(found)}", prompt, params)
        while llm.has_unfinished_requests():
            found += [fields(out)[2:] for out in llm.step()]
    finally:
        llm.eos_token_ids = kept
    return found
