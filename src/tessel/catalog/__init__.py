"""What hardware and models exist: GPU specs (`gpus.yaml`) and model shapes (HF config.json).

Cluster and workload files bundled with tessel live in `clusters/` and `workloads/` here; they are
loaded by `tessel.plan.files.cluster.load_cluster` and `tessel.plan.files.workload.load_workload`.
"""

from __future__ import annotations

from tessel.catalog.gpus import DTYPES, GpuSpec, get_gpu, known_gpus
from tessel.catalog.models import ModelSpec, known_models, load_model, model_from_config

__all__ = [
    "DTYPES",
    "GpuSpec",
    "ModelSpec",
    "get_gpu",
    "known_gpus",
    "known_models",
    "load_model",
    "model_from_config",
]
