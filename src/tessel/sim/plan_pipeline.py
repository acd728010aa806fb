"""Stage latencies of a plan file's stages, from the cost model (`tessel.cost`).

Stage j holding units U_j of the plan's model on a GPU of type `gpu_type`:

    prefill(c, p) = sum_{u in U_j} unit_prefill_time_s(u, c, p) (+ embedding of c tokens on the
                    first stage)
    prefill_logits(n) = final norm + LM head of n tokens on the last stage: the simulator adds it
                    for the prompts whose last chunk a batch holds (earlier chunks need no logits)
    decode(B, S)  = sum_{u in U_j} unit_decode_time_s(u, B, S) (+ embedding / LM head of B tokens)
    send(n)       = link latency + hidden_bytes(n) / link bandwidth   (0 on the last stage)

with the plan's dtype and kv_dtype; the analytic roofline (no profile: a plan file does not say
which profile its planner used). The link is the plan's `link_to_next`, whose `bandwidth_gbps` is
gigabits per second (as in cluster files, `tessel.plan.cluster`) and `latency_us` microseconds.
Units are whole layers (`granularity: layer`) or attention/MLP blocks (`sublayer`: unit 2i is
layer i's attention, 2i+1 its MLP).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from tessel.catalog.gpus import GpuSpec, get_gpu
from tessel.catalog.models import ModelSpec, load_model, model_from_config
from tessel.chunk.latency import PipelineLatency
from tessel.cost import (
    LinkSpec,
    activation_dtype,
    embed_time_s,
    hidden_bytes,
    link_time_s,
    lm_head_time_s,
    unit_decode_time_s,
    unit_prefill_time_s,
)
from tessel.errors import TesselError
from tessel.sim.plan_file import PlanFile, PlanStage, PlanVariant

GBPS = 1e9 / 8  # bytes/s in one Gb/s: the plan's bandwidth_gbps is gigabits per second
US = 1e-6


@dataclass(frozen=True, slots=True)
class CostModelStage:
    """A `StageLatency` for a run of units on one GPU, priced by the analytic cost model."""

    model: ModelSpec
    gpu: GpuSpec
    unit_counts: tuple[tuple[str, int], ...]  # (kind, how many) of the units this stage holds
    first: bool
    last: bool
    dtype: str = "fp16"
    kv_dtype: str = "fp16"
    link: LinkSpec | None = None

    def prefill_time_s(self, chunk_tokens: int, offset_tokens: int) -> float:
        if chunk_tokens <= 0:
            return 0.0
        model, gpu, dtypes = self.model, self.gpu, {"dtype": self.dtype, "kv_dtype": self.kv_dtype}
        time = sum(
            count * unit_prefill_time_s(model, gpu, kind, chunk_tokens, offset_tokens, **dtypes)
            for kind, count in self.unit_counts
        )
        if self.first:
            time += embed_time_s(self.model, self.gpu, chunk_tokens, self.dtype)
        return time

    def prefill_logits_time_s(self, prompts: int) -> float:
        """LM head of the last token of `prompts` finished prompts (last stage only)."""
        return lm_head_time_s(self.model, self.gpu, prompts, self.dtype) if self.last and prompts > 0 else 0.0

    def decode_time_s(self, batch_size: int, sum_context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        model, gpu, dtypes = self.model, self.gpu, {"dtype": self.dtype, "kv_dtype": self.kv_dtype}
        time = sum(
            count * unit_decode_time_s(model, gpu, kind, batch_size, sum_context_tokens, **dtypes)
            for kind, count in self.unit_counts
        )
        if self.first:
            time += embed_time_s(self.model, self.gpu, batch_size, self.dtype)
        if self.last:
            time += lm_head_time_s(self.model, self.gpu, batch_size, self.dtype)
        return time

    def send_time_s(self, tokens: int) -> float:
        if self.link is None or tokens <= 0:
            return 0.0
        return link_time_s(self.link, hidden_bytes(self.model, tokens, activation_dtype(self.dtype)))


def plan_model(plan: PlanFile) -> ModelSpec:
    model = plan.data.get("model")
    if not isinstance(model, dict) or "name" not in model:
        raise TesselError(f"{plan.path}: 'model' must be an object with a 'name'")
    config = model.get("config")
    if isinstance(config, dict) and config:
        return model_from_config(config, name=str(model["name"]), source=f"{plan.path} model.config")
    return load_model(str(model["name"]))


def pipeline_for(plan: PlanFile, variant: PlanVariant | None = None) -> PipelineLatency:
    """The `PipelineLatency` of the plan's stages (or of one of its baselines)."""
    variant = variant or plan.main
    model = plan_model(plan)
    granularity = str(plan.data.get("granularity", "layer"))
    if granularity not in ("layer", "sublayer"):
        raise TesselError(f"{plan.path}: granularity {granularity!r}, expected 'layer' or 'sublayer'")
    n_units = model.num_layers * (2 if granularity == "sublayer" else 1)
    stages = variant.stages
    if stages[0].unit_start != 0 or stages[-1].unit_end != n_units:
        raise TesselError(
            f"{plan.path}: {variant.name} covers units {stages[0].unit_start}..{stages[-1].unit_end}, "
            f"the model has {n_units} ({granularity} granularity)"
        )
    dtype, kv_dtype = str(plan.data.get("dtype", "fp16")), str(plan.data.get("kv_dtype", "fp16"))
    built = []
    for position, stage in enumerate(stages):
        built.append(
            CostModelStage(
                model=model,
                gpu=get_gpu(stage.gpu_type),
                unit_counts=_unit_counts(stage, granularity),
                first=position == 0,
                last=position == len(stages) - 1,
                dtype=dtype,
                kv_dtype=kv_dtype,
                link=None if position == len(stages) - 1 else _link(plan, stage),
            )
        )
    return PipelineLatency(tuple(built))


def _unit_counts(stage: PlanStage, granularity: str) -> tuple[tuple[str, int], ...]:
    units = range(stage.unit_start, stage.unit_end)
    if granularity == "layer":
        return (("layer", len(units)),)
    return tuple(sorted(Counter("attention" if u % 2 == 0 else "mlp" for u in units).items()))


def _link(plan: PlanFile, stage: PlanStage) -> LinkSpec:
    if stage.link_bandwidth_gbps is None:
        raise TesselError(f"{plan.path}: stage {stage.index} ({stage.device}) has no link_to_next")
    if stage.link_bandwidth_gbps <= 0:
        raise TesselError(f"{plan.path}: stage {stage.index} link bandwidth must be > 0")
    return LinkSpec(stage.link_bandwidth_gbps * GBPS, (stage.link_latency_us or 0.0) * US)
