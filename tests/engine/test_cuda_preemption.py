"""KV swap on a CUDA GPU: the host pool is pinned, blocks round-trip exactly between the device cache
and the pool, the host link is measured with real pinned copies, and a tiny KV pool under swap, auto
and recompute gives an unconstrained run's greedy tokens. Skipped where PyTorch sees no GPU (the CPU
paths: tests/engine/test_preemption.py)."""

from __future__ import annotations

import pytest
import torch

from tessel import LLM, SamplingParams
from tessel.engine.host_kv_pool import HostKvPool
from tessel.engine.preemption import measure_host_link

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
PARAMS = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
TIGHT = {"max_model_len": 96, "block_size": 4, "num_kv_blocks": 26, "max_num_seqs": 8}


@needs_cuda
def test_pinned_pool_round_trips_device_blocks() -> None:
    kv = torch.randn(2, 3, 11, 4, 2, 64, device="cuda", dtype=torch.float16)
    original = kv.clone()
    pool = HostKvPool(5, kv)
    assert pool.cache.is_pinned() and not pool.cache.is_cuda
    host = pool.allocate(3)
    pool.swap_out([7, 2, 9], host)
    kv[:, :, [7, 2, 9]] = 0
    pool.swap_in(host, [1, 10, 0])
    assert torch.equal(kv[:, :, [1, 10, 0]], original[:, :, [7, 2, 9]])


@needs_cuda
def test_host_link_is_measured_with_pinned_copies() -> None:
    link = measure_host_link(torch.device("cuda"))
    assert link.to_host_gbps > 0 and link.to_device_gbps > 0 and link.emulated_gbps is None
    print(f"host link: {link.to_device_gbps:.0f} Gbit/s to the device, {link.to_host_gbps:.0f} to the host")


@needs_cuda
@pytest.mark.parametrize("mode", ["swap", "auto", "recompute"])
def test_tiny_pool_on_cuda_gives_the_unconstrained_tokens(checkpoints, mode: str) -> None:
    path = checkpoints("qwen2")
    g = torch.Generator().manual_seed(7)
    ids = [torch.randint(4, 300, (30 + 3 * i,), generator=g).tolist() for i in range(5)]
    free = LLM(path, device="cuda", max_model_len=96, block_size=4, preemption_mode="recompute")
    expected = [o.token_ids for o in free.generate(ids, PARAMS, use_progress=False)]
    llm = LLM(path, device="cuda", preemption_mode=mode, **TIGHT)
    assert [o.token_ids for o in llm.generate(ids, PARAMS, use_progress=False)] == expected
    stats = llm.preemption_stats
    assert stats.swaps + stats.recomputes > 0
    if mode == "swap":
        assert stats.swaps > 0 and stats.bytes_to_host == stats.bytes_to_device
        assert llm.preemptor.pool.cache.is_pinned()
