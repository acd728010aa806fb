"""A micro-batch's message on the wire (`tessel.pipeline.comm.messages.pack_message`) comes back whole."""

import torch

from tessel.engine.sampling_params import SamplingParams
from tessel.kernels.paged_decode import decode_gather
from tessel.layers.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from tessel.pipeline.comm.messages import BatchMessage, pack_message, unpack_message


def _message() -> BatchMessage:
    tables = torch.tensor([[3, 4, 0], [5, 6, 7]], dtype=torch.int32)
    lens = torch.tensor([20, 40], dtype=torch.int32)
    gather = decode_gather(tables, lens, torch.zeros(8, 16, 3, 64))
    meta = AttentionMetadata(
        torch.arange(9, dtype=torch.int64) * 3,
        2,
        [DecodeGroup(0, 2, tables, lens, gather)],
        [PrefillChunk(2, 7, 7, torch.tensor([1, 2], dtype=torch.int64))],
    )
    return BatchMessage(
        7,
        torch.arange(9),
        meta,
        [1, 8],
        [(11, SamplingParams(temperature=0.5, seed=3)), (12, SamplingParams())],
        released=[4],
        resumed={11: 2},
        kv_copies=[("out", [1], [0])],
        host_kv_blocks=3,
    )


def test_message_round_trip_keeps_every_field_and_dtype():
    sent = _message()
    payload = pack_message(sent)
    assert payload.dtype == torch.uint8
    got = unpack_message(payload, torch.device("cpu"))
    assert got.batch_id == 7 and got.sample_rows == [1, 8] and got.released == [4]
    assert got.sample == sent.sample and got.resumed == {11: 2} and got.kv_copies == [("out", [1], [0])]
    assert torch.equal(got.positions, sent.positions) and got.positions.dtype == torch.int64
    assert torch.equal(got.meta.slot_mapping, sent.meta.slot_mapping)
    group, want = got.meta.decode_groups[0], sent.meta.decode_groups[0]
    assert group.block_tables.dtype == torch.int32 and torch.equal(group.block_tables, want.block_tables)
    assert torch.equal(group.context_lens, want.context_lens)
    assert (group.gather is None) == (want.gather is None)
    if want.gather is not None:
        assert torch.equal(group.gather.slots, want.gather.slots)
        assert torch.equal(group.gather.pad_bias, want.gather.pad_bias)
    assert torch.equal(got.meta.prefills[0].block_table, sent.meta.prefills[0].block_table)
    got.positions[0] = 5  # a received tensor is the stage's own (writable, not the payload's memory)


def test_dtypes_numpy_lacks_travel_too():
    message = _message()
    message.positions = torch.arange(4).to(torch.bfloat16)
    got = unpack_message(pack_message(message), torch.device("cpu"))
    assert got.positions.dtype == torch.bfloat16 and torch.equal(got.positions, message.positions)
