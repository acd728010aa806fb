"""tessel: plan and run LLM inference on clusters of different GPUs.

The planner side (`tessel.catalog`, `tessel.cost`, `tessel.plan`, `tessel.chunk`, `tessel.sim`)
imports without torch. `LLM` and `SamplingParams` need the `runtime` extra and are imported
lazily, so `import tessel` stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tessel.errors import TesselError

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "TesselError", "__version__"]

if TYPE_CHECKING:
    from tessel.engine.llm_engine import LLM
    from tessel.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from tessel.engine.llm_engine import LLM

        return LLM
    if name == "SamplingParams":
        from tessel.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'tessel' has no attribute {name!r}")
