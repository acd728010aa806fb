"""Plans other systems would pick, evaluated with the same `evaluate` as tessel's own.

- `uniform`: every device in cluster order, layers split evenly as vLLM does without
  VLLM_PP_LAYER_PARTITION (`vllm.distributed.utils.get_pp_indices`: L // S each, the remainder one
  extra layer to the second-to-last, third-to-last, ... stage, keeping the LM-head stage light);
- `memory_proportional`: every device, layers in proportion to device memory;
- `compute_proportional`: every device, layers in proportion to speed (1 / the device's prefill time
  for all units, i.e. its peak FLOP/s as the cost model sees it);
- `petals_greedy`: devices fastest first, each takes as many layers as fit in its memory
  (weights + KV + workspace, embedding / LM head included), as Petals servers do; idle after that.

Baselines place whole layers (a sublayer instance gets both units of a layer together). A baseline
that breaks memory is reported infeasible with the reason, not repaired.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessel.plan.instance import PlanningInstance
from tessel.plan.solution import Evaluation, Solution, evaluate

BASELINES = ("uniform", "memory_proportional", "compute_proportional", "petals_greedy")


@dataclass(frozen=True, slots=True)
class BaselineResult:
    name: str
    solution: Solution | None
    evaluation: Evaluation | None
    feasible: bool
    reason: str | None


def units_per_layer(instance: PlanningInstance) -> int:
    n_layers = len({unit.layer for unit in instance.units})
    if instance.n_units % n_layers:
        raise ValueError("units do not split evenly into layers")
    return instance.n_units // n_layers


def vllm_uniform_counts(n_layers: int, n_stages: int) -> list[int]:
    """Layers per stage as vLLM's get_pp_indices splits them by default."""
    counts = [n_layers // n_stages] * n_stages
    for i in range(2, n_layers % n_stages + 2):
        counts[-i] += 1
    return counts


def proportional_counts(n_layers: int, weights: np.ndarray) -> list[int]:
    """Largest-remainder rounding of n_layers * weights / sum(weights)."""
    share = n_layers * np.asarray(weights, dtype=float) / float(np.sum(weights))
    counts = np.floor(share).astype(int)
    for i in np.argsort(-(share - counts), kind="stable")[: n_layers - int(counts.sum())]:
        counts[i] += 1
    return [int(c) for c in counts]


def _from_layer_counts(instance: PlanningInstance, devices: list[int], counts: list[int]) -> Solution:
    per = units_per_layer(instance)
    return Solution.from_counts(devices, [c * per for c in counts])


def _result(
    instance: PlanningInstance, name: str, solution: Solution | None, why: str | None
) -> BaselineResult:
    if solution is None:
        return BaselineResult(name, None, None, False, why)
    evaluation = evaluate(instance, solution)
    reason = None if evaluation.feasible else "; ".join(evaluation.reasons)
    return BaselineResult(name, solution, evaluation, evaluation.feasible, reason)


def device_speed(instance: PlanningInstance) -> np.ndarray:
    """1 / (prefill time of all units) per device: relative peak compute."""
    return 1.0 / instance.prefill.unit_time_s.sum(axis=0)


def uniform(instance: PlanningInstance) -> BaselineResult:
    n_layers = instance.n_units // units_per_layer(instance)
    n_stages = min(instance.n_devices, n_layers)
    devices = list(range(n_stages))
    return _result(
        instance,
        "uniform",
        _from_layer_counts(instance, devices, vllm_uniform_counts(n_layers, n_stages)),
        None,
    )


def _proportional(instance: PlanningInstance, name: str, weights: np.ndarray) -> BaselineResult:
    """Every device in order, holding a share of the layers proportional to its weight."""
    n_layers = instance.n_units // units_per_layer(instance)
    counts = proportional_counts(n_layers, weights)
    return _result(
        instance, name, _from_layer_counts(instance, list(range(instance.n_devices)), counts), None
    )


def memory_proportional(instance: PlanningInstance) -> BaselineResult:
    memory = np.array([d.memory_bytes for d in instance.devices])
    return _proportional(instance, "memory_proportional", memory)


def compute_proportional(instance: PlanningInstance) -> BaselineResult:
    return _proportional(instance, "compute_proportional", device_speed(instance))


def petals_greedy(instance: PlanningInstance) -> BaselineResult:
    per = units_per_layer(instance)
    n_layers = instance.n_units // per
    layer_bytes = (instance.weight_bytes + instance.kv_bytes).reshape(n_layers, per).sum(axis=1)
    order = [int(j) for j in np.argsort(-device_speed(instance), kind="stable")]
    devices, counts, placed = [], [], 0
    for j in order:
        if placed == n_layers:
            break
        free = instance.devices[j].memory_bytes - float(instance.workspace_bytes[j])
        if placed == 0:
            free -= instance.first_bytes
        take = 0
        while placed + take < n_layers and layer_bytes[placed + take] <= free:
            free -= layer_bytes[placed + take]
            take += 1
        while placed + take == n_layers and take > 0 and instance.last_bytes > free:
            take -= 1  # the last stage also holds the LM head: give layers back until it fits
            free += layer_bytes[placed + take]
        if take > 0:
            devices.append(j)
            counts.append(take)
            placed += take
    if placed < n_layers:
        return _result(
            instance,
            "petals_greedy",
            None,
            f"devices filled greedily hold {placed} of {n_layers} layers; the rest do not fit in GPU memory",
        )
    return _result(instance, "petals_greedy", _from_layer_counts(instance, devices, counts), None)


def run_baselines(instance: PlanningInstance) -> dict[str, BaselineResult]:
    return {
        "uniform": uniform(instance),
        "memory_proportional": memory_proportional(instance),
        "compute_proportional": compute_proportional(instance),
        "petals_greedy": petals_greedy(instance),
    }
