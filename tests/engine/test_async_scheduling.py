"""Async scheduling (`async_scheduling=True`, `tessel.engine.run_ahead`, issue 47) against the engine
without it (the oracle): every request's tokens, text, finish reason and logprobs the same over random
requests with EOS, stop token ids, stop strings, max_tokens, max_model_len, sampling, logprobs, few KV
blocks (preemptions) and requests waiting behind max_num_seqs; decode steps really launched ahead; a
request failing on the worker thread fails alone; an abort while a step runs ahead; the settings that
cannot overlap refused."""

from __future__ import annotations

import random

import pytest

from random_requests import random_params
from tessel import LLM, SamplingParams
from tessel.errors import TesselError

RESULT_FIELDS = ("token_ids", "text", "finish_reason", "num_output_tokens", "logprobs", "prompt_logprobs")


def engine(checkpoints, overlap: bool, **kwargs) -> LLM:
    settings = dict(max_model_len=64, block_size=4, num_kv_blocks=48, max_num_seqs=6) | kwargs
    return LLM(checkpoints("llama"), async_scheduling=overlap, **settings)


@pytest.fixture(scope="module")
def engines(checkpoints):
    pair = engine(checkpoints, False), engine(checkpoints, True)
    yield pair
    for llm in pair:
        llm.shutdown()


def requests(seed: int, count: int = 14) -> list[tuple[str, list[int], SamplingParams]]:
    rng = random.Random(seed)
    return [
        (
            f"async-{seed}-{i}",
            [rng.randrange(5, 300) for _ in range(rng.randint(1, 12))],
            random_params(rng, i),
        )
        for i in range(count)
    ]


def run_to_end(llm: LLM, batch) -> dict[str, tuple]:
    """Each request's final output's fields, the requests added at once and stepped to the end."""
    for rid, prompt, params in batch:
        llm.add_request(rid, prompt, params)
    final = {}
    while llm.has_unfinished_requests():
        for out in llm.step():
            if out.finished:
                final[out.request_id] = result_of(out)
    return final


def result_of(out) -> tuple:
    return tuple(getattr(out, name) for name in RESULT_FIELDS)


def assert_same(got: dict[str, tuple], expected: dict[str, tuple]) -> None:
    """The same requests with the same tokens, texts and finish reasons, and logprobs within 1e-4: a
    row's batch differs with async scheduling (a request admitted a step later, rows of stopped
    requests computed and dropped), and float32 sums over another batch move a logprob's last digits."""
    assert got.keys() == expected.keys()
    for rid, fields in expected.items():
        assert got[rid][:4] == fields[:4], rid
        for mine, theirs in zip(got[rid][4:], fields[4:], strict=True):
            assert _flat(mine) == pytest.approx(_flat(theirs), abs=1e-4), rid


def _flat(logprobs) -> list:
    """Token ids and logprobs of a list of TokenLogprobs (None entries kept), in one flat list."""
    flat = []
    for entry in logprobs or []:
        if entry is None:
            flat.append(None)
            continue
        flat += [entry.token_id, entry.logprob]
        for token, logprob in entry.top:
            flat += [token, logprob]
    return flat


@pytest.mark.parametrize("seed", range(4))
def test_async_scheduling_gives_the_outputs_of_the_engine_without_it(engines, seed):
    sync, overlapped = engines
    ahead_before = overlapped.num_steps_ahead
    batch = requests(seed)
    expected = run_to_end(sync, batch)
    assert_same(run_to_end(overlapped, batch), expected)
    assert len(expected) == len(batch)
    assert overlapped.num_steps_ahead > ahead_before, "no decode step was launched ahead"
    assert sync.num_steps_ahead == 0
    assert overlapped.num_free_blocks == overlapped.num_total_blocks  # no block kept by a dropped row


@pytest.mark.parametrize("arch", ["gemma3", "qwen3_moe"])
def test_async_scheduling_on_windows_and_experts(checkpoints, arch):
    """Gemma 3 (sliding-window layers free blocks behind the window while a step runs ahead) and a
    mixture of experts: the same outputs as without async scheduling."""
    batch = requests(11, count=8)
    results = []
    for overlap in (False, True):
        llm = LLM(checkpoints(arch), async_scheduling=overlap, max_model_len=64, block_size=4, max_num_seqs=4)
        results.append(run_to_end(llm, batch))
        if overlap:
            assert llm.num_steps_ahead > 0
        llm.shutdown()
    assert_same(results[1], results[0])


def test_preemptions_happen_beside_steps_run_ahead(engines):
    """The pool is small enough that random requests preempt while other steps run ahead: the
    outputs test above covers the two together."""
    _, overlapped = engines
    preemptions, ahead = overlapped.scheduler.num_preemptions, overlapped.num_steps_ahead
    run_to_end(overlapped, requests(4))
    assert overlapped.scheduler.num_preemptions > preemptions and overlapped.num_steps_ahead > ahead


def test_rows_of_requests_stopped_by_a_token_are_dropped(engines):
    """Every request stops on a token (EOS or a stop token id) while its next step already runs:
    the row is computed there and dropped, the request's output ends at its stop token."""
    sync, overlapped = engines
    rng = random.Random(7)
    batch = []
    for i in range(6):
        prompt = [rng.randrange(5, 300) for _ in range(6)]
        free = sync.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0]
        stop_at = free.token_ids[4 + i % 4]  # a token it samples midway, never its first
        batch.append(
            (f"stop-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_at]))
        )
    expected = run_to_end(sync, batch)
    assert all(fields[2] == "stop" for fields in expected.values())
    before = overlapped.num_steps_ahead
    assert_same(run_to_end(overlapped, batch), expected)
    assert overlapped.num_steps_ahead > before


def test_requests_waiting_behind_max_num_seqs_are_served_alike(checkpoints):
    """More requests than max_num_seqs, greedy, each of its own length: the waiting ones are
    admitted as running ones finish (one step later with async scheduling), with the same tokens."""
    batch = [
        (
            f"wait-{i}",
            [5 + 7 * i + k for k in range(5)],
            SamplingParams(temperature=0.0, max_tokens=3 + 2 * i),
        )
        for i in range(10)
    ]
    results = []
    for overlap in (False, True):
        llm = engine(checkpoints, overlap, max_num_seqs=3)
        results.append(run_to_end(llm, batch))
        if overlap:
            assert llm.num_steps_ahead > 0
        llm.shutdown()
    assert_same(results[1], results[0])


def test_a_request_failing_on_the_worker_fails_alone(checkpoints, monkeypatch):
    """A request whose decode step raises on the worker thread (from its fourth token on) finishes
    with "error"; the others get their tokens as without it."""
    prompts = [[11, 12, 13], [21, 22, 23, 24], [31, 32]]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = engine(checkpoints, True)
    alone = [llm.generate([p], greedy)[0].token_ids for p in prompts]
    real_execute = llm.runner.execute

    def execute(prepared, seqs, scorings):
        if any(seq.prompt_token_ids == prompts[1] and seq.num_output_tokens >= 3 for seq in seqs):
            raise OverflowError("poisoned")
        return real_execute(prepared, seqs, scorings)

    monkeypatch.setattr(llm.runner, "execute", execute)
    outputs = llm.generate(prompts, greedy)
    assert [o.finish_reason for o in outputs] == ["length", "error", "length"]
    assert isinstance(outputs[1].error, OverflowError)
    assert [outputs[0].token_ids, outputs[2].token_ids] == [alone[0], alone[2]]
    assert outputs[1].token_ids == alone[1][: len(outputs[1].token_ids)]
    llm.shutdown()


def test_an_abort_while_a_step_runs_ahead(engines):
    """A request aborted between steps while decode steps run ahead ends with "abort"; the others
    finish as without async scheduling."""
    sync, overlapped = engines
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    batch = [(f"abort-{i}", [40 + i, 41, 42], greedy) for i in range(3)]
    expected = run_to_end(sync, batch[:1] + batch[2:])
    for rid, prompt, params in batch:
        overlapped.add_request(rid, prompt, params)
    final, steps = {}, 0
    while overlapped.has_unfinished_requests():
        for out in overlapped.step():
            if out.finished:
                final[out.request_id] = result_of(out)
        steps += 1
        if steps == 6:
            assert overlapped._in_flight and overlapped._in_flight[0].ahead
            overlapped.abort_request("abort-1")
    assert final.pop("abort-1")[2] == "abort"
    assert_same(final, expected)
    assert overlapped.num_free_blocks == overlapped.num_total_blocks


def test_async_scheduling_is_refused_where_steps_do_not_overlap(checkpoints):
    with pytest.raises(TesselError, match="tensor-parallel"):
        LLM(checkpoints("llama"), async_scheduling=True, tensor_parallel_size=2)
