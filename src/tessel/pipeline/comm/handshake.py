"""The collectives every stage takes part in at start, after joining the process group: what every
stage's KV pool and step graphs are sized by (`agree_kv_layout`), and a flow plan's block ranges per
path (`agree_flow_blocks`)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tessel.pipeline.comm.messages import KvLayout, PeerLostError
from tessel.pipeline.flow import FlowBlocks, FlowPath, path_block_ranges


def agree_kv_layout(capacity_blocks: int, stage0: KvLayout | None) -> KvLayout:
    """A collective at start: every stage offers the blocks its own budget holds (its layers, its
    device); all get the minimum, and stage 0's (`stage0`) block size, packing and limits."""
    try:
        blocks = torch.tensor([capacity_blocks], dtype=torch.int64)
        dist.all_reduce(blocks, op=dist.ReduceOp.MIN)
        fields = (
            [0, 0, 0, 0]
            if stage0 is None
            else [stage0.block_size, int(stage0.pack_cpu_linears), stage0.max_num_seqs, stage0.max_model_len]
        )
        shared = torch.tensor(fields, dtype=torch.int64)
        dist.broadcast(shared, src=0)
    except RuntimeError as error:
        raise PeerLostError(f"stage {dist.get_rank()}: the start-up handshake failed: {error}") from error
    block_size, pack, max_num_seqs, max_model_len = shared.tolist()
    return KvLayout(int(blocks.item()), block_size, bool(pack), max_num_seqs, max_model_len)


def agree_flow_blocks(paths: tuple[FlowPath, ...], rank: int, capacity: int, layout: KvLayout) -> FlowBlocks:
    """A collective after `agree_kv_layout`: every stage offers the blocks its own budget holds; all
    compute the same path ranges (`tessel.pipeline.flow.path_block_ranges`); -> this stage's view."""
    try:
        gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, torch.tensor([capacity], dtype=torch.int64))
    except RuntimeError as error:
        raise PeerLostError(f"stage {rank}: the KV block handshake failed: {error}") from error
    bs = layout.block_size
    blocks_per_seq = -(-layout.max_model_len // bs)
    ranges = path_block_ranges(paths, [int(t.item()) for t in gathered], blocks_per_seq, layout.max_num_seqs)
    return FlowBlocks.for_rank(paths, ranges, rank, bs)
