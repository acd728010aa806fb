"""Predicted MFU and MBU of each stage of a simulated run (`tessel.cost.utilization`).

A stage's work is summed over the micro-batches it computed, each priced as the simulator prices
its time: every prefill chunk (c tokens at offset p) on its own, the decode steps together (B
sequences, contexts summed), the LM head on the last stage for decode steps and finished prompts.
MFU and MBU are that work over the stage's busy seconds, against its device type's catalog peak
(scaled by the plan's `emulate_speed`). A tensor-parallel stage's figures are one rank's: its share of
the work (the sharded model's) against one GPU's peak.
"""

from __future__ import annotations

from tessel.catalog.gpus import get_gpu
from tessel.cost.layer import activation_dtype
from tessel.cost.roofline import lm_head_work
from tessel.cost.tensor_parallel import shard_model
from tessel.cost.utilization import (
    NO_WORK,
    Utilization,
    Work,
    stage_decode_work,
    stage_prefill_work,
    utilization,
    work_at_peak,
)
from tessel.plan.files.plan_file import PlanFile
from tessel.plan.files.plan_parts import PlanStage
from tessel.sim.simulator import SimResult


def _stage_work(plan: PlanFile, stage: PlanStage, intervals, last: bool) -> Work:
    model = shard_model(plan.model_spec, stage.tp_degree)
    gpu = get_gpu(stage.gpu_type).emulated(stage.emulate_speed)
    kinds = [plan.unit_kind(u) for u in range(stage.unit_start, stage.unit_end)]
    dtypes = list(stage.unit_precisions(plan.reference_dtype))
    head_dtype = plan.reference_dtype
    work = NO_WORK
    for interval in intervals:
        decodes = [item for item in interval.items if item.kind == "decode"]
        for item in interval.items:
            if item.kind == "prefill":
                work += stage_prefill_work(
                    model, gpu, kinds, dtypes, item.tokens, item.offset, kv_dtype=plan.kv_dtype
                )
        if decodes:
            contexts = sum(item.offset + 1 for item in decodes)
            batch = len(decodes)
            work += stage_decode_work(model, gpu, kinds, dtypes, batch, contexts, kv_dtype=plan.kv_dtype)
        if last:
            sampled = sum(1 for item in interval.items if item.samples)
            if sampled:
                flops, n_bytes = lm_head_work(model, sampled, head_dtype)
                work += work_at_peak(gpu, activation_dtype(head_dtype), flops, 0.0, n_bytes)
    return work


def stage_utilization(
    plan: PlanFile, stages: tuple[PlanStage, ...] | list[PlanStage], result: SimResult, busy_s
) -> list[Utilization]:
    """Per stage of `stages` (the simulated variant's), its predicted MFU and MBU over `busy_s`."""
    out = []
    for index, stage in enumerate(stages):
        intervals = [i for i in result.intervals if i.kind == "compute" and i.stage == index]
        work = _stage_work(plan, stage, intervals, index == len(stages) - 1)
        gpu = get_gpu(stage.gpu_type).emulated(stage.emulate_speed)
        out.append(utilization(work, busy_s[index], gpu))
    return out
