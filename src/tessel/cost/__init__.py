"""The cost model: how long a unit of a model takes on a device, and how many bytes it holds.

`layer` counts parameters, FLOPs and bytes; `roofline` turns them into seconds (or uses a measured
`profile`); `link` prices transfers between devices and to host memory. Pure Python, no torch.
"""

from __future__ import annotations

from tessel.cost.layer import (
    DTYPE_BYTES,
    activation_dtype,
    dtype_bytes,
    embedding_bytes,
    hidden_bytes,
    kv_bytes_per_token,
    layer_params,
    lm_head_bytes,
    profile_shape,
    total_params,
    unit_params,
    weight_bytes,
    workspace_bytes,
)
from tessel.cost.link import LinkSpec, device_to_host_time_s, host_to_device_time_s, link_time_s
from tessel.cost.profile import DecodeFit, PrefillFit, Profile, load_profile
from tessel.cost.roofline import (
    DEFAULT_COMPUTE_EFFICIENCY,
    DEFAULT_MEMORY_EFFICIENCY,
    KERNEL_LAUNCH_OVERHEAD_S,
    Efficiency,
    embed_time_s,
    lm_head_time_s,
    select_profile,
    unit_decode_time_s,
    unit_prefill_time_s,
)

__all__ = [
    "DEFAULT_COMPUTE_EFFICIENCY",
    "DEFAULT_MEMORY_EFFICIENCY",
    "DTYPE_BYTES",
    "KERNEL_LAUNCH_OVERHEAD_S",
    "DecodeFit",
    "Efficiency",
    "LinkSpec",
    "PrefillFit",
    "Profile",
    "activation_dtype",
    "device_to_host_time_s",
    "dtype_bytes",
    "embed_time_s",
    "embedding_bytes",
    "hidden_bytes",
    "host_to_device_time_s",
    "kv_bytes_per_token",
    "layer_params",
    "link_time_s",
    "lm_head_bytes",
    "lm_head_time_s",
    "load_profile",
    "profile_shape",
    "select_profile",
    "total_params",
    "unit_decode_time_s",
    "unit_params",
    "unit_prefill_time_s",
    "weight_bytes",
    "workspace_bytes",
]
