"""Which part of a checkpoint one pipeline stage holds: a run of decoder layers, plus the embedding
on the first stage and the final norm + LM head on the last.

`prune(model)` replaces what the stage does not hold by `nn.Identity` while the model is still on
the meta device, so those parts never get memory, and gives the model its part: its forward then
runs this stage (`tessel.models.llama.LlamaModel.forward`); `holds(name)` tells the loader which
checkpoint tensors to read. With tied embeddings the last stage holds the embedding matrix as its
LM head. `host_layers` are layers of the stage whose weights the loader puts in host memory: the
runtime streams them to the device before they run (`tessel.engine.weight_stream`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from torch import nn

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True, slots=True)
class LayerFilter:
    layer_start: int  # decoder layers [layer_start, layer_end)
    layer_end: int
    embed: bool  # the token embedding (first stage)
    head: bool  # the final norm and the LM head (last stage)
    tied: bool = False  # the LM head is the embedding matrix (tie_word_embeddings)
    host_layers: frozenset[int] = frozenset()  # layers loaded into host memory, streamed in to run

    def __post_init__(self) -> None:
        if not 0 <= self.layer_start < self.layer_end:
            raise ValueError(f"a stage needs layers [start, end) with 0 <= start < end, got {self}")
        if not all(self.holds_layer(index) for index in self.host_layers):
            raise ValueError(f"host layers {sorted(self.host_layers)} are not all layers of the stage {self}")

    @property
    def needs_embedding(self) -> bool:
        return self.embed or (self.head and self.tied)

    def holds_layer(self, index: int) -> bool:
        return self.layer_start <= index < self.layer_end

    def holds(self, name: str) -> bool:
        """Whether checkpoint tensor `name` (HF naming) belongs to this stage."""
        layer = _LAYER.match(name)
        if layer:
            return self.holds_layer(int(layer.group(1)))
        if name.startswith("model.embed_tokens."):
            return self.needs_embedding
        if name.startswith(("model.norm.", "lm_head.")):
            return self.head
        return True  # anything else is checked by the loader as usual

    def prune(self, model: nn.Module) -> None:
        """Drop (on the meta device) the modules of a `LlamaForCausalLM` this stage does not hold;
        the model then runs this stage's part."""
        inner = model.model
        inner.part = self
        for index in range(len(inner.layers)):
            if not self.holds_layer(index):
                inner.layers[index] = nn.Identity()
        if not self.needs_embedding:
            inner.embed_tokens = nn.Identity()
        if not self.head:
            inner.norm = nn.Identity()
            model.lm_head = nn.Identity()
