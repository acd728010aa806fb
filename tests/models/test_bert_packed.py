"""The packed (padding-free) BERT forward: inputs end to end, attention per run of equal lengths,
against HF transformers' `BertModel` run on each input alone."""

from __future__ import annotations

import pytest
import torch

from encoder_models import make_tiny_bert
from tessel.errors import TesselError
from tessel.models.bert import Runs, load_bert
from tessel.models.reader import read_encoder


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_bert(tmp_path_factory.mktemp("packed") / "tiny")
    return path, load_bert(read_encoder(path), torch.float32)


def test_packed_forward_matches_transformers_per_input(tiny):
    from transformers import BertModel

    path, model = tiny
    oracle = BertModel.from_pretrained(str(path), add_pooling_layer=False).eval()
    generator = torch.Generator().manual_seed(0)
    lengths = [5, 5, 9, 1, 5, 12, 12, 3]  # unsorted, repeated: runs of several inputs and of one
    ids = torch.randint(0, model.config.vocab_size, (sum(lengths),), generator=generator)
    with torch.inference_mode():
        ours = model.forward_packed(ids, lengths)
        expected = torch.cat([oracle(input_ids=row[None]).last_hidden_state[0] for row in ids.split(lengths)])
        padded = model(*_padded(ids, lengths))  # the masked path agrees too
    assert ours.shape == (sum(lengths), model.config.hidden_size)
    assert (ours - expected).abs().max() < 1e-5
    mask = _padded(ids, lengths)[1].bool()
    assert (padded[mask] - ours).abs().max() < 1e-5


def _padded(ids: torch.Tensor, lengths: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = ids.split(lengths)
    input_ids = torch.zeros(len(rows), max(lengths), dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, row in enumerate(rows):
        input_ids[i, : len(row)], mask[i, : len(row)] = row, 1
    return input_ids, mask


def test_runs_group_equal_neighbours_and_bad_packing_is_refused(tiny):
    runs = Runs.from_lengths([3, 3, 2, 3])
    assert runs.runs == ((2, 3), (1, 2), (1, 3))
    assert runs.positions_.tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 0, 1, 2]
    with pytest.raises(TesselError, match="at least one token"):
        Runs.from_lengths([2, 0])
    with pytest.raises(TesselError, match="add up to 5"):
        tiny[1].forward_packed(torch.zeros(4, dtype=torch.long), [2, 3])
