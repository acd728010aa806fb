"""Sentence embeddings from a BERT-family encoder: tokenizer + encoder + pooling, batched by length.

    embedder = Embedder("/models/all-MiniLM-L6-v2")
    vectors = embedder.embed(["a sentence", "another one"])     # float32 [2, 384], CPU

Texts are stripped (and lower-cased where `sentence_bert_config.json` says `do_lower_case`), then
tokenized with the checkpoint's tokenizer, special tokens included, as sentence-transformers does.
Token id inputs are a text's tokens without special tokens (what `tokenizer(text,
add_special_tokens=False)` gives); [CLS] and [SEP] are added around them. An input longer than
`max_tokens` (the model's `max_seq_length`, else its positions) is refused naming the limit, or
cut to it with `truncate=True` (sentence-transformers always cuts).

Inputs are sorted by token count and run `batch_size` at a time, then returned in the order given.
A batch runs packed, with no padding: its inputs' tokens end to end (`BertEncoder.forward_packed`),
so the linears, GELU, LayerNorms and residual adds see only real tokens, and attention runs once per
run of equal-length inputs (sorting makes those runs long). Batches larger than the default 32 bring
nothing on a CPU (bigger activations fall out of cache); `batch_size` stays the unit the server
interleaves requests by. `threads` sets torch's CPU threads (process-wide).
`dimensions` shortens vectors (first d values, renormalised where the model normalises): allowed
only for a model trained for it (Matryoshka; `matryoshka=True`), or d equal to the full size.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from tessel.dtypes import AUTO, runtime_dtype_name
from tessel.errors import TesselError
from tessel.models.bert import Packing, load_bert
from tessel.models.config import TORCH_DTYPES
from tessel.models.reader import read_encoder
from tessel.models.sentence_pooling import PoolingConfig, pool, read_pooling
from tessel.text import check_texts

DEFAULT_BATCH_SIZE = 32  # sentence-transformers' encode() default


class Embedder:
    def __init__(
        self,
        path: str | Path,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        batch_size: int = DEFAULT_BATCH_SIZE,
        threads: int | None = None,
        matryoshka: bool = False,
        option: str = "--model",
    ) -> None:
        if batch_size < 1:
            raise TesselError(f"batch_size must be >= 1, got {batch_size}")
        checked = read_encoder(path, option)
        self.path, self.config = checked.path, checked.config
        self.pooling: PoolingConfig = read_pooling(checked.path)
        self.tokenizer = _tokenizer(checked.path)
        self.max_tokens = _max_tokens(self.pooling, self.config.max_position_embeddings, self.tokenizer)
        self.device = torch.device(device)
        if threads is not None:
            torch.set_num_threads(threads)
        self.model = load_bert(checked, _dtype(dtype, self.config.checkpoint_dtype), self.device)
        self.batch_size, self.matryoshka = batch_size, matryoshka
        self.dimensions = self.config.hidden_size * len(self.pooling.modes)
        self.model_name = checked.path.name
        self._framing = _special_framing(self.tokenizer)

    # ---- tokens --------------------------------------------------------------------------------

    def tokenize(self, texts: Sequence[str], truncate: bool = False) -> list[list[int]]:
        """Each text's token ids with special tokens; too long: refused, or cut with `truncate`; a
        text that is not valid Unicode (`tessel.text.check_text`): refused."""
        prepared = [text.strip() for text in check_texts(texts, "input")]
        if self.pooling.do_lower_case:
            prepared = [text.lower() for text in prepared]
        if not prepared:
            return []
        kwargs = {"truncation": True, "max_length": self.max_tokens} if truncate else {"verbose": False}
        ids = self.tokenizer(prepared, add_special_tokens=True, **kwargs)["input_ids"]
        self.check_lengths(ids)
        return [list(row) for row in ids]

    def with_special_tokens(self, ids: Sequence[int], truncate: bool = False) -> list[int]:
        """A text's token ids (no special tokens) framed as the tokenizer frames a text."""
        bad = [i for i in ids if not 0 <= i < self.config.vocab_size]
        if bad:
            vocab = self.config.vocab_size
            raise TesselError(f"token id {bad[0]} is outside this model's vocabulary [0, {vocab})")
        prefix, suffix = self._framing
        framed = prefix + list(ids) + suffix
        if truncate and len(framed) > self.max_tokens:
            framed = framed[: self.max_tokens - 1] + framed[-1:]
        self.check_lengths([framed])
        return framed

    def check_lengths(self, ids: Sequence[Sequence[int]]) -> None:
        for index, row in enumerate(ids):
            if len(row) > self.max_tokens:
                raise TesselError(
                    f"input {index} has {len(row)} tokens; this model reads at most {self.max_tokens} "
                    "(max_seq_length); shorten it"
                )

    # ---- running -------------------------------------------------------------------------------

    def batches(self, ids: Sequence[Sequence[int]]) -> list[list[int]]:
        """Indices of `ids` in batches of similar length (longest first)."""
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        return [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]

    def run_batch(self, ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """Pooled (and normalised) float32 vectors of one batch, on the CPU."""
        lengths = [len(row) for row in ids]
        packed = torch.tensor([token for row in ids for token in row], dtype=torch.long, device=self.device)
        mask = torch.zeros((len(ids), max(lengths)), dtype=torch.long)
        for row, length in enumerate(lengths):
            mask[row, :length] = 1
        mask = mask.to(self.device)
        with torch.inference_mode():
            hidden = Packing.from_mask(mask).pad(self.model.forward_packed(packed, lengths))
            return pool(hidden, mask, self.pooling).cpu()

    def embed_ids(self, ids: Sequence[Sequence[int]], dimensions: int | None = None) -> torch.Tensor:
        """Vectors [len(ids), dimensions] for token id lists with special tokens (as `tokenize` gives)."""
        self.check_dimensions(dimensions)
        self.check_lengths(ids)
        out = torch.empty((len(ids), self.dimensions), dtype=torch.float32)
        for batch in self.batches(ids):
            out[batch] = self.run_batch([ids[i] for i in batch])
        return self.shorten(out, dimensions)

    def embed(
        self, texts: Sequence[str], truncate: bool = False, dimensions: int | None = None
    ) -> torch.Tensor:
        """Vectors [len(texts), dimensions] (float32, CPU) for the texts, in their order."""
        return self.embed_ids(self.tokenize(texts, truncate), dimensions)

    # ---- dimensions ----------------------------------------------------------------------------

    def check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None or dimensions == self.dimensions:
            return
        if not self.matryoshka:
            raise TesselError(
                f"this model gives {self.dimensions}-dimensional embeddings and was not declared trained for "
                "shorter ones (Matryoshka); leave `dimensions` out, or start tessel with --matryoshka"
            )
        if not 1 <= dimensions <= self.dimensions:
            raise TesselError(f"dimensions must be in [1, {self.dimensions}], got {dimensions}")

    def shorten(self, vectors: torch.Tensor, dimensions: int | None) -> torch.Tensor:
        if dimensions is None or dimensions == self.dimensions:
            return vectors
        short = vectors[:, :dimensions]
        return torch.nn.functional.normalize(short, p=2, dim=1) if self.pooling.normalize else short.clone()


def _tokenizer(path: Path):  # noqa: ANN202 (a transformers tokenizer)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as error:  # noqa: BLE001 (whatever transformers raises, the directory is at fault)
        raise TesselError(f"{path}: cannot load its tokenizer ({type(error).__name__}: {error})") from None


def _special_framing(tokenizer) -> tuple[list[int], list[int]]:  # noqa: ANN001
    """The special tokens the tokenizer puts before and after a text's tokens ([CLS] ... [SEP])."""
    framed = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    plain = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    for start in range(len(framed) - len(plain) + 1):
        if framed[start : start + len(plain)] == plain:
            return framed[:start], framed[start + len(plain) :]
    return [], []


def _max_tokens(pooling: PoolingConfig, positions: int, tokenizer) -> int:  # noqa: ANN001
    """sentence-transformers' max_seq_length, else the tokenizer's limit, never past the positions."""
    limit = pooling.max_seq_length or getattr(tokenizer, "model_max_length", positions)
    return min(int(limit), positions) if isinstance(limit, int) else positions


def _dtype(name: str, checkpoint: str) -> torch.dtype:
    key = runtime_dtype_name(name)  # the one dtype vocabulary (tessel.dtypes); int8/fp8 refused
    key = checkpoint.removeprefix("torch.") if key == AUTO else key
    if key not in TORCH_DTYPES:
        raise TesselError(f"dtype {name!r} is not supported; use float32, bfloat16, float16 or auto")
    return TORCH_DTYPES[key]
