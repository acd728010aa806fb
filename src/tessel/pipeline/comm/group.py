"""Joining a plan's process group: gloo, plus NCCL where a link runs GPU to GPU (each tensor's
device picks its backend), and one gloo group per stage that samples, shared with stage 0, for the
tokens coming back (`tessel.pipeline.comm.tokens`)."""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from tessel.pipeline.comm.links import StageComm
from tessel.pipeline.devices import link_transports, process_group_backend, stage_device
from tessel.pipeline.flow import PathFeatures, last_ranks, plan_paths
from tessel.pipeline.run_plan import RunPlan

# Idle stages wait for work without limit (a server may idle for hours); a dead peer is noticed
# by its closed connection and by the supervisor, not by this timeout.
COMM_TIMEOUT = timedelta(days=7)


def join_pipeline(
    plan: RunPlan,
    rank: int,
    transport: str,
    dtype: torch.dtype,
    init_method: str | None = None,
    micro_batches: int | None = None,
) -> StageComm:
    """Join the stages' process group as stage `rank` -> its links (`init_method` None: torchrun's
    environment, MASTER_ADDR and MASTER_PORT)."""
    device = torch.device(stage_device(plan.stages[rank]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    transports = link_transports(plan, transport) if PathFeatures.of(plan).nccl else []
    dist.init_process_group(
        process_group_backend(transports),
        init_method=init_method,
        rank=rank,
        world_size=len(plan.stages),
        timeout=COMM_TIMEOUT,
    )
    paths = plan_paths(plan, micro_batches)
    token_groups = {}
    for source in last_ranks(paths):  # every rank takes part in making each, in the same order
        if source != 0:
            token_groups[source] = dist.new_group([0, source], timeout=COMM_TIMEOUT, backend="gloo")
    links = {(k, k + 1): kind for k, kind in enumerate(transports)}
    return StageComm(rank, device, dtype, paths, links, token_groups)
