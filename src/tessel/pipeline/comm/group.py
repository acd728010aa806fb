"""Joining a plan's process group: gloo, plus NCCL where a link runs GPU to GPU (each tensor's
device picks its backend), and one gloo group per stage that samples, shared with stage 0, for the
tokens coming back (`tessel.pipeline.comm.tokens`)."""

from __future__ import annotations

import os
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from tessel.pipeline.comm.links import StageComm
from tessel.pipeline.devices import link_transports, process_group_backend, stage_device
from tessel.pipeline.flow import PathFeatures, last_ranks, plan_paths
from tessel.pipeline.run_plan import RunPlan

# Idle stages wait for work without limit (a server may idle for hours); a dead peer is noticed
# by its closed connection and by the supervisor, not by this timeout.
COMM_TIMEOUT = timedelta(days=7)
AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"  # "True": torchrun's agent serves the store at MASTER_PORT


def join_pipeline(
    plan: RunPlan,
    rank: int,
    transport: str,
    dtype: torch.dtype,
    init_method: str | None = None,
    micro_batches: int | None = None,
    listen_fd: int | None = None,
) -> StageComm:
    """Join the stages' process group as stage `rank` -> its links (`init_method` None: torchrun's
    environment, MASTER_ADDR and MASTER_PORT). `listen_fd`: stage 0's socket bound to that port
    since the stages were started (`tessel.ports`), which the group's store then listens on."""
    device = torch.device(stage_device(plan.stages[rank]))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    transports = link_transports(plan, transport) if PathFeatures.of(plan).nccl else []
    world_size = len(plan.stages)
    dist.init_process_group(
        process_group_backend(transports),
        store=rendezvous_store(init_method, rank, world_size, listen_fd),
        rank=rank,
        world_size=world_size,
        timeout=COMM_TIMEOUT,
    )
    paths = plan_paths(plan, micro_batches)
    token_groups = {}
    for source in last_ranks(paths):  # every rank takes part in making each, in the same order
        if source != 0:
            token_groups[source] = dist.new_group([0, source], timeout=COMM_TIMEOUT, backend="gloo")
    links = {(k, k + 1): kind for k, kind in enumerate(transports)}
    return StageComm(rank, device, dtype, paths, links, token_groups)


def rendezvous_address(init_method: str | None) -> tuple[str, int]:
    """(host, port) of the group's store: `tcp://HOST:PORT`, or MASTER_ADDR and MASTER_PORT."""
    if init_method is None:
        return os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    where = urlparse(init_method)
    if where.scheme != "tcp" or where.hostname is None or where.port is None:
        raise ValueError(f"a pipeline joins over tcp://HOST:PORT, not {init_method!r}")
    return where.hostname, where.port


def rendezvous_store(
    init_method: str | None, rank: int, world_size: int, listen_fd: int | None = None
) -> dist.Store:
    """The group's key-value store: stage 0 serves it (on `listen_fd` when it holds the port already),
    the others connect to it, retrying until it is up, as torch's tcp:// rendezvous does. Under
    torchrun's elastic agent the agent serves it and every stage connects."""
    host, port = rendezvous_address(init_method)
    serves = rank == 0 and os.environ.get(AGENT_STORE_ENV) != "True"
    fd = listen_fd if serves else None
    store = dist.TCPStore(host, port, world_size, serves, timeout=COMM_TIMEOUT, master_listen_fd=fd)
    return dist.PrefixStore("tessel/pipeline", store)  # apart from the keys of an agent sharing it
