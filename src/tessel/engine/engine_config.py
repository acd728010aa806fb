"""Engine settings (the keyword arguments of `LLM` / `LLMEngine`), validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tessel.engine.limits import check_emulate_host_gbps, check_kv_cache_gib
from tessel.engine.preemption import check_preemption_mode
from tessel.errors import TesselError
from tessel.models.quantized.lm_head import check_lm_head_mode

DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # tokens per step; large enough for efficient CPU GEMMs
DEFAULT_KV_CACHE_BYTES = 2 * 2**30  # cap on the default pool (max_num_seqs * max_model_len tokens)


@dataclass(slots=True)
class EngineConfig:
    dtype: str | torch.dtype = "float32"
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    kv_cache_gib: float | None = None  # None: room for max_num_seqs full-length sequences, capped
    block_size: int = 16
    enable_prefix_caching: bool = True
    max_num_batched_tokens: int | None = None  # None: 2048 (or max_model_len without chunking)
    enable_chunked_prefill: bool = True
    num_kv_blocks: int | None = None  # exact pool size in blocks (overrides kv_cache_gib; for tests)
    pack_cpu_linears: bool = True  # float32 on CPU: oneDNN-packed linears (tessel.layers.linear)
    lm_head: str = "float"  # "int8": the LM head rounded per row at load (tessel.models.quantized.lm_head)
    # True: every step eager: no compiled CPU decode graph and no captured CUDA graphs
    # (tessel.engine.step_plan)
    enforce_eager: bool = False
    device: str = "cpu"  # "cpu", "cuda" or "cuda:N": where the weights, the KV cache and the kernels run
    # what a preempted request's KV blocks get: "swap" (to the host pool and back), "recompute", or
    # "auto": the cheaper of the two for that request (tessel.engine.preemption)
    preemption_mode: str = "auto"
    host_kv_cache_gib: float | None = None  # None: as many blocks as the device pool, at most 4 GiB
    # slow host <-> device KV copies to this bandwidth (Gbit/s): emulates a host link on a CPU-only machine
    emulate_host_gbps: float | None = None
    # ranks the model is split over (tessel.parallel): this process is rank 0, the others processes
    # it starts, each with this process's torch thread count
    tensor_parallel_size: int = 1
    # decode steps overlapped with the host's work: the next step prepared while one computes and
    # launched before its tokens are applied (tessel.engine.run_ahead); one process only
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise TesselError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.block_size < 1:
            raise TesselError(f"block_size must be >= 1, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise TesselError(f"max_model_len must be >= 2, got {self.max_model_len}")
        self.kv_cache_gib = check_kv_cache_gib(self.kv_cache_gib, "kv_cache_gib")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise TesselError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.tensor_parallel_size < 1:
            raise TesselError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.async_scheduling and self.tensor_parallel_size > 1:
            raise TesselError(
                "async_scheduling runs in one process; tensor-parallel stages do not overlap their steps yet"
            )
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise TesselError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        check_lm_head_mode(self.lm_head)
        check_preemption_mode(self.preemption_mode)
        self.host_kv_cache_gib = check_kv_cache_gib(self.host_kv_cache_gib, "host_kv_cache_gib")
        self.emulate_host_gbps = check_emulate_host_gbps(self.emulate_host_gbps, "emulate_host_gbps")
        self.device = str(parse_device(self.device))


def parse_device(device: str | torch.device) -> torch.device:
    """The torch device for `device`, refused with a reason unless it is the CPU or a CUDA GPU
    that this PyTorch build can see."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise TesselError(
            f"device {device!r} is not a device name; use cpu, cuda or cuda:N ({error})"
        ) from None
    if parsed.type == "cpu":
        return torch.device("cpu")
    if parsed.type != "cuda":
        raise TesselError(f"device {device!r}: tessel's engine runs on cpu or cuda, not {parsed.type}")
    if not torch.cuda.is_available():
        raise TesselError(
            f"device {device!r}: this PyTorch sees no CUDA GPU (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda or 'none'}); use --device cpu or install a CUDA build"
        )
    count = torch.cuda.device_count()
    if parsed.index is not None and parsed.index >= count:
        raise TesselError(
            f"device {device!r}: this machine has {count} CUDA device(s), cuda:0..cuda:{count - 1}"
        )
    return torch.device("cuda", parsed.index if parsed.index is not None else torch.cuda.current_device())
