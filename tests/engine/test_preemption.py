"""Preemption by swap or recompute (tessel.engine.preemption): a tiny KV pool gives an unconstrained
run's greedy tokens under every mode (and HF's under swap), blocks round-trip exactly, auto follows
the costs, a full host pool falls back to recompute, bad settings are refused before loading."""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from hf_oracle import hf_greedy
from tessel import LLM, SamplingParams
from tessel.cli import app
from tessel.engine import emulation
from tessel.engine.block_manager import BlockManager
from tessel.engine.emulation import hold_link
from tessel.engine.engine_config import EngineConfig
from tessel.engine.host_kv_pool import HostKvPool
from tessel.engine.limits import MIN_KV_CACHE_GIB
from tessel.engine.preemption import HostLink, Preemptor, PrefillClock, host_pool_blocks, measure_host_link
from tessel.engine.sequence import Sequence
from tessel.errors import TesselError
from tessel.plan.files.plan_parts import MIN_EMULATE_HOST_GBPS
from tessel.server.prometheus import ServerMetrics

PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
TIGHT = {"max_model_len": 96, "block_size": 4, "num_kv_blocks": 26, "max_num_seqs": 8}
TIGHT["max_num_batched_tokens"] = 32


def prompts(vocab_size: int, n: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(4, vocab_size, (30 + 3 * i,), generator=g).tolist() for i in range(n)]


@pytest.fixture(scope="module")
def reference(checkpoints):
    """The unconstrained run's token ids (a pool large enough for every request at once)."""
    path = checkpoints("qwen2")
    llm = LLM(path, max_model_len=96, block_size=4, preemption_mode="recompute")
    ids = prompts(llm.model_config.vocab_size)
    outputs = llm.generate(ids, PARAMS, use_progress=False)
    assert llm.scheduler.num_preemptions == 0
    return path, ids, [o.token_ids for o in outputs]


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_a_tiny_pool_gives_the_unconstrained_tokens_under_every_mode(reference, mode: str) -> None:
    path, ids, expected = reference
    llm = LLM(path, preemption_mode=mode, **TIGHT)
    outputs = llm.generate(ids, PARAMS, use_progress=False)
    assert [o.token_ids for o in outputs] == expected
    stats = llm.preemption_stats
    assert llm.scheduler.num_preemptions == stats.swaps + stats.recomputes > 0
    if mode == "swap":
        assert stats.swaps > 0 and stats.recomputes == 0
        assert stats.bytes_to_host == stats.bytes_to_device > 0
        for out in outputs[:2]:  # HF transformers, the oracle, for a few of them
            assert out.token_ids == hf_greedy(path, out.prompt_token_ids, 40, ignore_eos=True)
    if mode == "recompute":
        assert stats.swaps == 0 and stats.bytes_to_host == 0
    if mode == "auto":  # a memcpy of a few KiB beats prefilling tens of tokens, even on a loaded machine
        assert stats.swaps > 0
    assert llm.num_free_blocks == llm.num_total_blocks
    pool = llm.preemptor.pool
    assert pool is None or pool.num_free_blocks == pool.num_total_blocks


def test_auto_recomputes_behind_the_slowest_emulated_link(reference) -> None:
    path, ids, expected = reference
    llm = LLM(path, preemption_mode="auto", emulate_host_gbps=MIN_EMULATE_HOST_GBPS, **TIGHT)
    assert llm.preemptor.link.to_host_gbps == MIN_EMULATE_HOST_GBPS
    outputs = llm.generate(ids, PARAMS, use_progress=False)
    assert [o.token_ids for o in outputs] == expected
    assert llm.preemption_stats.swaps == 0 and llm.preemption_stats.recomputes > 0


def test_a_full_host_pool_falls_back_to_recompute(reference) -> None:
    path, ids, expected = reference
    one_block_bytes = 2 * 2 * 4 * 1 * 16 * 4  # k and v, 2 layers, 4 tokens, 1 kv head of 16, fp32
    assert one_block_bytes <= MIN_KV_CACHE_GIB * 2**30 < 2 * one_block_bytes  # the floor holds one block
    llm = LLM(path, preemption_mode="swap", host_kv_cache_gib=MIN_KV_CACHE_GIB, **TIGHT)
    assert llm.preemptor.pool.num_total_blocks == 1
    outputs = llm.generate(ids, PARAMS, use_progress=False)
    assert [o.token_ids for o in outputs] == expected
    stats = llm.preemption_stats
    assert stats.swap_fallbacks > 0 and stats.recomputes == stats.swap_fallbacks
    assert llm.preemptor.pool.num_free_blocks == 1


def test_aborting_a_swapped_request_frees_its_host_blocks(reference) -> None:
    path, ids, _ = reference
    llm = LLM(path, preemption_mode="swap", **TIGHT)
    for i, prompt in enumerate(ids):
        llm.add_request(f"r{i}", prompt, PARAMS)
    while llm.preemption_stats.swaps == 0:
        llm.step()
    swapped = [seq for seq in llm.scheduler.waiting if seq.host_blocks]
    assert swapped and llm.preemptor.pool.num_free_blocks < llm.preemptor.pool.num_total_blocks
    for seq in list(llm.scheduler.waiting) + list(llm.scheduler.running):
        llm.abort_request(seq.request_id)
    assert llm.preemptor.pool.num_free_blocks == llm.preemptor.pool.num_total_blocks
    assert llm.num_free_blocks == llm.num_total_blocks


def test_metrics_count_preemptions_by_mode_and_bytes(reference) -> None:
    path, ids, _ = reference
    llm = LLM(path, preemption_mode="swap", **TIGHT)
    before = ServerMetrics(llm).render().decode()
    assert 'tessel:num_preemptions_total{mode="swap"} 0.0' in before
    llm.generate(ids, PARAMS, use_progress=False)
    text = ServerMetrics(llm).render().decode()
    stats = llm.preemption_stats
    assert f'tessel:num_preemptions_total{{mode="swap"}} {float(stats.swaps)}' in text
    assert f'tessel:kv_swap_bytes_total{{direction="to_host"}} {float(stats.bytes_to_host)}' in text
    assert "tessel:kv_swap_fallbacks_total 0.0" in text and stats.swaps > 0


def test_the_host_pool_round_trips_blocks_exactly() -> None:
    kv = torch.randn(2, 3, 11, 4, 2, 5)
    original = kv.clone()
    pool = HostKvPool(6, kv)
    assert not pool.cache.is_pinned()  # pinned only for a CUDA cache (tests/engine/test_cuda_preemption.py)
    host = pool.allocate(3)
    assert host is not None and pool.allocate(4) is None and pool.num_free_blocks == 3
    moved = pool.swap_out([7, 2, 9], host)
    assert moved.num_bytes == 3 * 2 * 3 * 4 * 2 * 5 * 4
    kv[:, :, [7, 2, 9]] = float("nan")
    pool.swap_in(host, [1, 10, 0])
    assert torch.equal(kv[:, :, [1, 10, 0]], original[:, :, [7, 2, 9]])
    pool.free(host)
    assert pool.num_free_blocks == 6
    with pytest.raises(AssertionError):
        pool.free(host)


def test_emulation_sleeps_for_the_missing_time(monkeypatch) -> None:
    slept = []
    monkeypatch.setattr(emulation.time, "sleep", slept.append)
    assert hold_link(2_000_000, 0.0005, 8.0) == pytest.approx(0.0015)  # 2 MB at 8 Gbit/s: 2 ms
    assert slept == [pytest.approx(0.0015)]
    assert hold_link(2_000_000, 0.005, 8.0) == 0.0 and len(slept) == 1  # already slower
    assert hold_link(2_000_000, 0.001, None) == 0.0


def _preemptor(to_host_gbps: float, seconds_per_token: float) -> tuple[Preemptor, Sequence]:
    bm = BlockManager(8, 4)
    kv = torch.zeros(2, 2, 8, 4, 2, 8)
    clock = PrefillClock()
    clock.record(100, 100 * seconds_per_token)
    link = HostLink(to_host_gbps, to_host_gbps, 10.0, 10.0)
    seq = Sequence("s", list(range(10)), SamplingParams(), 4)
    bm.allocate(seq, 0)
    seq.num_computed_tokens = 10
    return Preemptor("auto", bm, HostKvPool(4, kv), link, clock), seq


def test_auto_weighs_the_link_against_prefill_time() -> None:
    # 3 blocks of 2*2*4*2*8*4 = 1 KiB: 6 KiB moved out and in
    fast, seq = _preemptor(to_host_gbps=10.0, seconds_per_token=1e-3)  # ~10 us against 10 ms
    assert fast.choose(seq) == "swap"
    slow, seq = _preemptor(to_host_gbps=1e-6, seconds_per_token=1e-3)  # ~100 s against 10 ms
    assert slow.choose(seq) == "recompute"
    assert slow.preempt(seq) == "recompute" and seq.num_computed_tokens == 0
    fast, seq = _preemptor(to_host_gbps=10.0, seconds_per_token=1e-3)
    assert fast.preempt(seq) == "swap" and seq.num_computed_tokens == 10 and len(seq.host_blocks) == 3
    assert fast.block_manager.num_free_blocks == 8
    fresh = Preemptor("auto", fast.block_manager, fast.pool, fast.link)  # no prefill timed yet
    assert fresh.choose(seq) == "recompute"


def test_the_host_pool_is_sized_by_the_setting_or_capped_by_default() -> None:
    assert host_pool_blocks(0.5, 2**20, 10, None) == 512  # as asked, larger than the device pool
    assert host_pool_blocks(None, 1000, 50, None) == 50  # as many blocks as the device pool
    assert host_pool_blocks(None, 2**20, 10**9, None) == 4096  # at most 4 GiB
    assert host_pool_blocks(None, 1000, 10**9, 2 * 10**6) == 1000  # at most half the available memory
    # a pipeline stage with half the layers: half the bytes, blocks of half the size, as many blocks
    assert host_pool_blocks(0.5, 2**19, 10, None, layer_share=0.5) == 512


def test_the_host_link_is_measured_and_capped_by_emulation() -> None:
    link = measure_host_link(torch.device("cpu"), num_bytes=1 << 20)
    assert link.to_host_gbps > 0 and link.to_device_gbps > 0 and link.emulated_gbps is None
    slow = measure_host_link(torch.device("cpu"), emulated_gbps=1e-3, num_bytes=1 << 20)
    assert slow.to_host_gbps == slow.to_device_gbps == 1e-3 and slow.measured_to_host_gbps > 1e-3


@pytest.mark.parametrize(
    "setting",
    [
        {"emulate_host_gbps": 0},
        {"emulate_host_gbps": math.nan},
        {"emulate_host_gbps": -2.0},
        {"emulate_host_gbps": math.inf},
        {"emulate_host_gbps": 1e-12},  # issue 42: each swap waited years of emulated link time
        {"host_kv_cache_gib": 0},
        {"host_kv_cache_gib": math.nan},
        {"host_kv_cache_gib": 1e-12},
        {"kv_cache_gib": 0},
        {"kv_cache_gib": -1.0},
        {"kv_cache_gib": math.nan},
        {"kv_cache_gib": 1e-9},
        {"preemption_mode": "offload"},
    ],
)
def test_bad_settings_are_refused_by_the_config(setting) -> None:
    with pytest.raises(TesselError, match=next(iter(setting))):
        EngineConfig(**setting)


def test_bad_host_pools_are_refused_before_any_request(checkpoints) -> None:
    path = checkpoints("qwen2")
    with pytest.raises(TesselError, match="more host memory than is available"):
        LLM(path, host_kv_cache_gib=1e7)
    with pytest.raises(TesselError, match="holds no KV block"):  # the floor: one 4-token block, not 16
        LLM(path, host_kv_cache_gib=MIN_KV_CACHE_GIB, max_model_len=96)


def test_generate_takes_the_preemption_options(checkpoints) -> None:
    path = checkpoints("qwen2")
    args = ["generate", "--model", str(path), "--prompt", "Hello world", "--max-tokens", "4", "--ignore-eos"]
    args += ["--preemption-mode", "swap", "--host-kv-cache-gib", "0.01", "--emulate-host-gbps", "100"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "finish_reason=length" in result.output


@pytest.mark.parametrize(
    ("command", "option", "value", "message"),
    [
        ("generate", "--emulate-host-gbps", "0", "'--emulate-host-gbps': 0 is below 0.001"),
        ("generate", "--emulate-host-gbps", "-3", "'--emulate-host-gbps': -3 is below 0.001"),
        ("generate", "--emulate-host-gbps", "1e-12", "'--emulate-host-gbps': 1e-12 is below 0.001"),
        ("serve", "--emulate-host-gbps", "nan", "'--emulate-host-gbps': NaN is not a number"),
        ("serve", "--host-kv-cache-gib", "0", "'--host-kv-cache-gib': 0 is below 1e-06"),
        ("generate", "--preemption-mode", "offload", "--preemption-mode"),
    ],
)
def test_cli_refuses_bad_preemption_options(checkpoints, command, option, value, message) -> None:
    args = [command, "--model", str(checkpoints("qwen2")), option, value]
    args += ["--prompt", "x"] if command == "generate" else []
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2
    assert message in " ".join((str(result.exception) + result.output).replace("\u2502", " ").split())
