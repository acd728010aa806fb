"""A decode step's host work does not grow with the requests that wait (issue 47): counted in Python
function calls per step (deterministic, unlike time), with and without a long queue behind
`max_num_seqs`."""

from __future__ import annotations

import sys

from tessel import LLM, SamplingParams

RUNNING = 4
STEPS = 6


def _calls_per_step(model, waiting: int) -> list[int]:
    llm = LLM(str(model), max_num_seqs=RUNNING, max_model_len=128, kv_cache_gib=0.01)
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    for i in range(RUNNING + waiting):
        llm.add_request(f"r{i}", [5 + (i + k) % 50 for k in range(8)], params)
    for _ in range(3):  # prefill and the first decodes
        llm.step()
    assert len(llm.scheduler.running) == RUNNING and len(llm.scheduler.waiting) == waiting
    counts = []
    for _ in range(STEPS):
        calls = [0]

        def count(frame, event, arg, calls=calls):
            if event in ("call", "c_call"):
                calls[0] += 1

        sys.setprofile(count)
        try:
            llm.step()
        finally:
            sys.setprofile(None)
        counts.append(calls[0])
    return counts


def test_a_decode_step_does_the_same_work_with_a_thousand_requests_waiting(checkpoints):
    model = checkpoints("llama")
    alone = _calls_per_step(model, waiting=0)
    queued = _calls_per_step(model, waiting=1000)
    # the same calls step by step, give or take the scheduler's one look at the queue's head
    assert all(abs(a - q) <= 8 for a, q in zip(alone, queued, strict=True)), (alone, queued)
