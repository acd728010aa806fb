"""A pipeline stage split over tensor-parallel ranks: the stage's process is their leader.

To the pipeline around it (the executor, the supervisor, the other stages) the stage is one
process: it receives the micro-batch or the stream as any stage does, and its runner
(`LeaderRunner`) broadcasts each forward to its followers; the last stage's LM head gathers the
logits on the leader, which samples. The followers are this process's children.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tessel.models.config import ModelConfig
from tessel.models.layer_filter import LayerFilter
from tessel.models.llama import LlamaForCausalLM
from tessel.parallel.executor import check_tensor_parallel
from tessel.parallel.group import TPGroup
from tessel.parallel.load import load_rank
from tessel.parallel.ranks import TPRanks


@dataclass
class TPStage:
    ranks: TPRanks
    group: TPGroup
    model: LlamaForCausalLM  # the leader's shards of the stage's layers


def load_tp_stage(
    path: Path,
    dtype: torch.dtype,
    device: str,
    part: LayerFilter,
    degree: int,
    rank: int,
    gpus: list[int] | None = None,
    run_dir: Path | None = None,
    precisions: dict[int, tuple[str, str]] | None = None,
) -> TPStage:
    """Stage `rank`'s layers over `degree` ranks: its followers started (they load while this
    process does), joined, and this process's shards loaded; `precisions`: the plan's per-layer
    weight precisions, rounded as one process rounds them (`tessel.parallel.quantize`)."""
    where = f"stage {rank}"
    split = check_tensor_parallel(ModelConfig.from_dir(path), degree, device, gpus, where)
    ranks = TPRanks(degree, run_dir or Path(tempfile.mkdtemp(prefix="tessel-tp-")), prefix=f"stage{rank}.")
    group = ranks.start(path, dtype, device, gpus, layers=part, precisions=precisions)
    try:
        model = load_rank(path, dtype, group, split, part, precisions).model
    except Exception as error:
        ranks.stop(None)
        raise ranks.named(error) from error
    return TPStage(ranks, group, model)
