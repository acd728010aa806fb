"""Build a model from a local Hugging Face directory and load its safetensors lazily.

The directory is checked first by the one model reader (`tessel.models.reader.read_model`: config,
safetensors headers, every tensor's shape against the config), so nothing is allocated for a model
the files cannot hold. Parameters are created on the meta device (no random init), materialised
empty in the target dtype, then filled tensor by tensor from `safe_open` (single file or sharded
with `model.safetensors.index.json`), so peak memory is the model plus one checkpoint tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tessel.errors import TesselError
from tessel.models.checkpoint_names import parameter_of, shard_view, shards_of
from tessel.models.layer_filter import LayerFilter
from tessel.models.llama import LlamaForCausalLM
from tessel.models.quantized import module_swap
from tessel.models.quantized.lm_head import check_lm_head_mode, quantize_lm_head
from tessel.models.reader import SKIPPED_SUFFIXES, checkpoint_files, read_model

__all__ = ["checkpoint_files", "default_dtype", "load_model", "load_weights", "materialise"]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def load_model(
    path: str | Path,
    dtype: torch.dtype,
    device: str | torch.device = "cpu",
    layers: LayerFilter | None = None,
    lm_head: str = "float",
) -> LlamaForCausalLM:
    """The model in `path`; with `layers`, only that pipeline stage's part (the rest is nn.Identity);
    `lm_head="int8"` rounds the LM head per row (`tessel.models.quantized.lm_head`)."""
    check_lm_head_mode(lm_head)
    if lm_head != "float" and layers is not None:
        raise TesselError(f"lm_head={lm_head!r} cannot run as a pipeline stage yet; run in one process")
    checked = read_model(path)  # config and weights agree before anything is allocated
    path, config = checked.path, checked.config
    with torch.device("meta"), default_dtype(dtype):
        model = LlamaForCausalLM(config)
        if layers is not None:
            layers.prune(model)
    scheme = checked.scheme  # a compressed-tensors checkpoint: quantised linears
    if scheme is not None:
        if layers is not None:
            raise TesselError(
                f"{path}: a quantised checkpoint cannot run as a pipeline stage yet; "
                "run it in one process (tessel generate / serve without --plan)"
            )
        module_swap.drop_linears(model)
    model = materialise(model, device, layers.host_layers if layers is not None else frozenset())
    if config.tie_word_embeddings and not isinstance(model.lm_head, torch.nn.Identity):
        model.lm_head.tie(model.model.embed_tokens)  # to_empty gives each module its own tensor: tie again
    for rotary in model.model.rotaries():
        rotary.build_tables(device)
    if scheme is None:
        load_weights(model, path, layers)
    else:
        load_weights(model, path, skip=module_swap.is_quantized_tensor)
        module_swap.load_linears(model, list(checked.files), scheme, dtype, device)
    if lm_head == "int8":
        model.lm_head = quantize_lm_head(model.lm_head, scheme, dtype, device)
    return model.eval().requires_grad_(False)


def materialise(model: LlamaForCausalLM, device: str | torch.device, host_layers: frozenset[int]):
    """Materialise the meta model on `device`, the decoder layers in `host_layers` in host memory."""
    held = {index: model.model.layers[index] for index in sorted(host_layers)}
    for index in held:
        model.model.layers[index] = torch.nn.Identity()
    model = model.to_empty(device=device)
    for index, layer in held.items():
        model.model.layers[index] = layer.to_empty(device="cpu")
    return model


def load_weights(
    model: LlamaForCausalLM,
    path: Path,
    layers: LayerFilter | None = None,
    skip: Callable[[str], bool] | None = None,
) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {(name, shard) for name in params for shard in shards_of(name, model.config)}
    if model.config.tie_word_embeddings:
        expected.discard(("lm_head.weight", None))
    loaded: set[tuple[str, Hashable]] = set()
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if (
                        name.endswith(SKIPPED_SUFFIXES)
                        or (name == "lm_head.weight" and model.config.tie_word_embeddings)
                        or (skip is not None and skip(name))
                    ):
                        continue
                    if layers is not None and not layers.holds(name):
                        continue  # another pipeline stage's tensor: never read
                    loaded.add(_load_tensor(model, params, name, f.get_tensor(name), file))
        except (SafetensorError, OSError) as error:  # truncated, corrupt or unreadable
            raise TesselError(
                f"{file}: not a readable safetensors file ({error}); it may be truncated, re-download it"
            ) from None
    missing = sorted(
        f"{name}" if shard is None else f"{name}[shard {shard}]" for name, shard in expected - loaded
    )
    if missing:
        raise TesselError(
            f"{path}: the checkpoint lacks {len(missing)} tensor(s), e.g. {', '.join(missing[:5])}"
        )


def _load_tensor(
    model: LlamaForCausalLM,
    params: dict[str, torch.nn.Parameter],
    name: str,
    tensor: torch.Tensor,
    file: Path,
) -> tuple[str, Hashable]:
    config = model.config
    target, shard = parameter_of(name, config)
    param = params.get(target)
    if param is None:
        raise TesselError(f"{file.name}: unexpected tensor {name!r}; is this really a {config.architecture}?")
    data = shard_view(target, param.data, shard, config)
    if tuple(data.shape) != tuple(tensor.shape):
        raise TesselError(
            f"{file.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
            f"config.json implies {tuple(data.shape)}"
        )
    data.copy_(tensor)
    if config.gemma and name.endswith("norm.weight"):
        data.add_(1.0)  # Gemma's RMSNorm scales by (1 + w): stored so, it runs as every RMSNorm
    return target, shard
