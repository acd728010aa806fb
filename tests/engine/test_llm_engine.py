"""LLMEngine / LLM behaviour: stop rules, streaming deltas, aborts, seeds, validation."""

from __future__ import annotations

import json
import shutil

import pytest

from tessel import LLM, SamplingParams, TesselError
from tessel.engine.llm_engine import LLMEngine, RequestOutput

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def llm(checkpoints) -> LLM:
    return LLM(checkpoints("llama"), max_model_len=128, block_size=4)


def greedy(max_tokens: int = 30, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_stop_string_ends_the_request_and_is_cut_from_the_text(llm: LLM) -> None:
    full = llm.generate(PROMPT, greedy())[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 30
    stop = full.text[len(full.text) // 2 :][:3]
    assert stop, full.text
    out = llm.generate(PROMPT, greedy(stop=[stop, "never-appears"]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    assert full.token_ids[: len(out.token_ids)] == out.token_ids
    assert len(out.token_ids) < 30


def test_stop_token_ids_and_eos_end_the_request_and_stay_in_token_ids(llm: LLM) -> None:
    full = llm.generate(PROMPT, greedy())[0]
    stop_id = full.token_ids[4]
    cut = full.token_ids.index(stop_id) + 1
    out = llm.generate(PROMPT, greedy(stop_token_ids=[stop_id]))[0]
    assert out.token_ids == full.token_ids[:cut] and out.finish_reason == "stop"

    eos = llm.eos_token_ids
    llm.eos_token_ids = frozenset({stop_id})
    try:
        by_eos = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=30))[0]
        ignoring = llm.generate(PROMPT, greedy())[0]
    finally:
        llm.eos_token_ids = eos
    assert by_eos.token_ids == full.token_ids[:cut] and by_eos.finish_reason == "stop"
    assert ignoring.token_ids == full.token_ids


def test_max_tokens_none_runs_to_max_model_len(llm: LLM) -> None:
    ids = llm.tokenize(PROMPT)
    out = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0]
    assert len(ids) + len(out.token_ids) == llm.max_model_len
    assert out.finish_reason == "length"


def test_stream_deltas_add_up_and_never_show_a_cut_stop_string(llm: LLM) -> None:
    full = llm.generate(PROMPT, greedy())[0]
    stop = full.text[len(full.text) // 2 :][:4]
    for params in (greedy(), greedy(stop=[stop])):
        chunks = list(llm.stream(PROMPT, params))
        final = chunks[-1]
        assert final.finished and all(not c.finished for c in chunks[:-1])
        assert "".join(c.new_text for c in chunks) == final.text
        assert [t for c in chunks for t in c.new_token_ids] == final.token_ids
        assert all(final.text.startswith(c.text) for c in chunks)
        assert final.text == llm.generate(PROMPT, params)[0].text
    assert llm.num_free_blocks == llm.num_total_blocks


def test_text_is_the_decoded_output(llm: LLM) -> None:
    out = llm.generate(PROMPT, greedy())[0]
    assert out.text == llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.prompt_token_ids == llm.tokenize(PROMPT) and out.num_prompt_tokens == len(out.prompt_token_ids)
    m = out.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finish_time


def test_abort_frees_blocks_at_once_and_reports_abort(llm: LLM) -> None:
    engine: LLMEngine = llm
    engine.add_request("a", PROMPT, greedy(40))
    engine.add_request("b", "Hello world!", greedy(40))
    engine.add_request("c", "Once upon a time", greedy(40))  # aborted while waiting or running
    for _ in range(3):
        engine.step()
    free = engine.num_free_blocks
    engine.abort_request("a")
    assert engine.num_free_blocks > free
    assert engine.num_unfinished_requests == 2
    engine.abort_request("c")
    engine.abort_request("does-not-exist")
    outputs = engine.step()
    aborted = {o.request_id: o for o in outputs if o.finish_reason == "abort"}
    assert set(aborted) == {"a", "c"} and all(o.finished for o in aborted.values())
    finished: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finished] == ["b"] and len(finished[0].token_ids) == 40
    assert engine.num_free_blocks == engine.num_total_blocks


def test_step_reports_only_requests_that_changed(llm: LLM) -> None:
    engine: LLMEngine = llm
    engine.add_request("x", list(range(5, 60)), greedy(3))  # 55-token prompt
    engine.scheduler.config.max_num_batched_tokens = 16  # four chunks before the first token
    try:
        sizes = [len(engine.step()) for _ in range(4)]
    finally:
        engine.scheduler.config.max_num_batched_tokens = 2048
    assert sizes == [0, 0, 0, 1]
    while engine.has_unfinished_requests():
        engine.step()


def test_seeded_sampling_is_reproducible_and_batch_independent(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, max_tokens=20, seed=7, ignore_eos=True)
    alone = llm.generate(PROMPT, params)[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True)
    batch = llm.generate(["Hello", PROMPT, "Once upon a time"], [others, params, others])
    assert batch[1].token_ids == alone
    other_seed = SamplingParams(temperature=1.0, max_tokens=20, seed=8, ignore_eos=True)
    assert llm.generate(PROMPT, other_seed)[0].token_ids != alone


def test_token_id_prompts_and_input_order(llm: LLM) -> None:
    prompts = [[1, 50, 60, 70], [1, 5], [1, 9, 9, 9, 9, 9, 9, 9, 9, 9]]
    outs = llm.generate(prompts, greedy(5))
    assert [o.prompt_token_ids for o in outs] == prompts and all(o.prompt is None for o in outs)
    single = llm.generate([1, 50, 60, 70], greedy(5))
    assert single[0].token_ids == outs[0].token_ids


def test_request_validation(llm: LLM) -> None:
    with pytest.raises(TesselError, match="max_model_len=128"):
        llm.add_request("long", list(range(1, 120)), SamplingParams(max_tokens=20))
    with pytest.raises(TesselError, match="empty"):
        llm.add_request("empty", [], SamplingParams())
    with pytest.raises(TesselError, match="vocabulary"):
        llm.add_request("oov", [1, 10_000], SamplingParams())
    llm.add_request("dup", [1, 2], SamplingParams(max_tokens=1))
    with pytest.raises(TesselError, match="already in use"):
        llm.add_request("dup", [1, 2], SamplingParams())
    llm.abort_request("dup")
    llm.step()
    with pytest.raises(TesselError, match="top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(TesselError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(TesselError):  # one bad prompt in a batch: nothing is left behind
        llm.generate(["ok", list(range(1, 200))], greedy(4))
    assert not llm.has_unfinished_requests() and llm.num_free_blocks == llm.num_total_blocks


def test_engine_construction_errors(checkpoints, tmp_path) -> None:
    src = checkpoints("llama")
    with pytest.raises(TesselError, match="does not exist"):
        LLMEngine(tmp_path / "nope")
    with pytest.raises(TesselError, match="max_position_embeddings"):
        LLMEngine(src, max_model_len=10**6)
    with pytest.raises(TesselError, match="fewer than max_model_len"):
        LLMEngine(src, max_model_len=512, num_kv_blocks=4)
    with pytest.raises(TesselError, match="chunked"):
        LLMEngine(src, max_model_len=512, max_num_batched_tokens=64, enable_chunked_prefill=False)
    with pytest.raises(TesselError, match="dtype"):
        LLMEngine(src, dtype="int8")
    bad = tmp_path / "gpt"
    shutil.copytree(src, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(TesselError, match="GPT2LMHeadModel.*Gemma3ForCausalLM.*--runnable"):
        LLMEngine(bad)


def test_engine_attributes_for_the_server(llm: LLM, checkpoints) -> None:
    assert llm.model_name == checkpoints("llama").name
    assert llm.max_model_len == 128
    assert llm.tokenizer.eos_token_id in llm.eos_token_ids
    assert llm.num_total_blocks >= 128 // 4


def test_decode_rows_go_to_one_paged_attention_call_in_order(llm: LLM) -> None:
    from tessel.engine.scheduler import SchedulerOutput
    from tessel.engine.sequence import Sequence

    seqs = []
    for length, blocks in ((5, [3, 9]), (9, [7, 1, 4]), (4, [2])):  # block_size 4
        seq = Sequence(f"decode-{length}", list(range(4, 4 + length)), greedy(), block_size=4)
        seq.block_table, seq.num_computed_tokens = blocks, length - 1
        seqs.append(seq)
    ids, positions, meta, sample_rows = llm.runner.prepare(SchedulerOutput(decodes=seqs))
    assert positions.tolist() == [4, 8, 3] and ids.tolist() == [8, 12, 7]
    assert meta.slot_mapping.tolist() == [9 * 4 + 0, 4 * 4 + 0, 2 * 4 + 3]
    (group,) = meta.decode_groups
    assert (group.start, group.end, meta.num_decode_tokens) == (0, 3, 3)
    assert group.context_lens.tolist() == [5, 9, 4]
    assert group.block_tables.tolist() == [[3, 9, 0], [7, 1, 4], [2, 0, 0]]
    assert sample_rows == [0, 1, 2]


def test_closing_a_stream_early_aborts_its_request(llm: LLM) -> None:
    stream = llm.stream(PROMPT, greedy(30))
    first = next(stream)
    assert not first.finished and len(first.token_ids) == 1
    stream.close()
    assert not llm.has_unfinished_requests()
    assert llm.num_free_blocks == llm.num_total_blocks
