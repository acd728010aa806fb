"""Small tensor-parallel planning cases shared by the tests/plan/test_tp_*.py files."""

from __future__ import annotations

from dataclasses import replace

from tessel.catalog.models import load_model
from tessel.plan.build import build_instance
from tessel.plan.files.cluster import parse_cluster
from tessel.plan.files.workload import parse_workload
from tessel.plan.tp.tp_instance import TpContext

NETWORK = {"bandwidth_gbps": 25, "latency_us": 20}


def cluster(*nodes: tuple[str, str, int, str], host_gib: float = 0.0):
    """A cluster of (name, GPU type, count, intra_link) nodes."""
    data = {
        "name": "tp-test",
        "nodes": [
            {"name": n, "gpus": {"type": t, "count": c}, "intra_link": link, "host_memory_gib": host_gib}
            for n, t, c, link in nodes
        ],
    }
    if len(nodes) > 1:
        data["network"] = NETWORK
    return parse_cluster(data, source="tp-test")


def workload(batch: int = 4, micro_batches: int = 2, prompt: int = 256, output: int = 64):
    return parse_workload(
        {
            "name": "tp-test",
            "prompt_tokens": prompt,
            "output_tokens": output,
            "batch_size": batch,
            "max_micro_batch": micro_batches,
        }
    )


def small_model(layers: int = 4, name: str = "llama-3-70b"):
    """A real model's layer shape with few layers (fast brute force, same TP arithmetic)."""
    return replace(load_model(name), num_layers=layers)


def problem(model, the_cluster, the_workload, **options):
    """The base (degree-1) instance and the TP context of a case."""
    base = build_instance(model, the_cluster, the_workload, **options)
    return base, TpContext(model, the_cluster, the_workload)
