"""A CPU tensor-parallel stage priced as the simulator sees it: the busiest rank of an uneven split
(`TensorParallel.rank_model`), `tessel profile --tensor-parallel-size` timing that rank's shapes,
and the shared-memory all-reduce's ring-formula fit (`tessel.profiling.all_reduce`)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cli.cli_helpers import user_error
from tessel.catalog.models import load_model
from tessel.chunk.from_plan import StageSpec, build_pipeline
from tessel.cost import layer as L
from tessel.cost.link import LinkSpec
from tessel.cost.tensor_parallel import TensorParallel, shard_model, uneven_rank_model
from tessel.models.config import ModelConfig
from tessel.parallel.split import TPSplit
from tessel.profiling.all_reduce import AllReduceTiming, measure_shm_all_reduce

LINK = LinkSpec(20e9, 8e-6)


def smollm2_like(layers: int = 3):
    """9 heads over 3 KV heads: a degree of 2 splits them unevenly."""
    return replace(
        load_model("llama-3-8b"),
        name="smollm2-like",
        num_layers=layers,
        hidden_size=576,
        intermediate_size=1536,
        num_heads=9,
        num_kv_heads=3,
        head_dim=64,
        vocab_size=49152,
    )


def one_stage(model, tp):  # noqa: ANN001, ANN201
    stage = StageSpec("cpu0", "cpu", 0, model.num_layers, None, node="h", tp=tp)
    return build_pipeline(model, [stage], dtype="fp32", kv_dtype="fp32").pipeline.stages[0]


def test_an_uneven_stage_is_its_busiest_rank_plus_its_all_reduces() -> None:
    """Decode of B sequences: the rank's own layers, embedding and head (priced as a one-GPU stage of
    the rank's shard), plus 2 all-reduces a layer and one after the embedding of B rows, and the
    logits gather of B rows of every rank's vocabulary columns."""
    model = smollm2_like()
    rank = uneven_rank_model(model, 2, heads=6, kv_heads=2, intermediate_size=768)
    assert (rank.num_heads, rank.num_kv_heads, rank.head_dim, rank.vocab_size) == (6, 2, 64, 24576)
    tp = TensorParallel(2, LINK, rank)
    alone, parallel = one_stage(rank, None), one_stage(model, tp)
    for batch, context in ((1, 100), (32, 32 * 160)):
        hidden = L.hidden_bytes(rank, batch, "fp32")
        comm = (2 * model.num_layers + 1) * tp.all_reduce_s(hidden)
        comm += tp.all_gather_s(batch * rank.vocab_size * 2 * 4)
        assert parallel.decode_time_s(batch, context) == pytest.approx(
            alone.decode_time_s(batch, context) + comm
        )


def test_without_a_rank_model_the_even_shard_prices_the_stage() -> None:
    model = replace(smollm2_like(), num_heads=8, num_kv_heads=2)
    even = one_stage(model, TensorParallel(2, LINK))
    named = one_stage(model, TensorParallel(2, LINK, shard_model(model, 2)))
    assert even.decode_time_s(8, 800) == named.decode_time_s(8, 800)
    assert even.prefill_time_s(256, 0) == named.prefill_time_s(256, 0)


def test_a_rank_holds_a_head_a_kv_head_and_a_column() -> None:
    with pytest.raises(ValueError, match="at least one head"):
        uneven_rank_model(smollm2_like(), 2, heads=0, kv_heads=0, intermediate_size=8)


def test_the_fit_recovers_the_ring_formula() -> None:
    """Times made by the formula itself (3 ranks: 4 steps of n/3 bytes) give back its link."""
    latency, bandwidth, degree = 7e-6, 30e9, 3
    sizes = (2304, 18432, 294912, 4718592)
    seconds = tuple(TensorParallel(degree, LinkSpec(bandwidth, latency)).all_reduce_s(n) for n in sizes)
    link = AllReduceTiming(degree, sizes, seconds).link()
    assert link.latency_s == pytest.approx(latency) and link.bandwidth_bytes_per_s == pytest.approx(bandwidth)


def test_two_ranks_time_their_shared_memory_all_reduce() -> None:
    timing = measure_shm_all_reduce(2, 64, token_counts=(1, 256))
    assert timing.n_bytes == (256, 65536) and all(s > 0 for s in timing.seconds)
    link = timing.link()
    assert link.bandwidth_bytes_per_s > 0 and link.latency_s >= 0


def test_profile_times_rank_zero_of_the_engines_split(checkpoints) -> None:  # noqa: ANN001
    from tessel.commands.profile import _layer_shape, _rank_shape

    path = checkpoints("llama_linear_mha")  # 4 heads over 4 KV heads
    shape, meta, ends, checkpoint = _layer_shape(str(path), None, 1, "cpu")
    layer, rank_ends = _rank_shape(shape, ends, checkpoint, 2, meta)
    rank = TPSplit.of(ModelConfig.from_dir(path), 2).shards[0]
    assert (layer.num_heads, layer.num_kv_heads, layer.intermediate_size) == (
        rank.num_heads,
        rank.num_kv_heads,
        rank.intermediate_size,
    )
    assert layer.head_dim == shape.head_dim and layer.hidden_size == shape.hidden_size
    assert rank_ends.vocab_size == rank.vocab_rows and meta["tp_degree"] == "2"


def test_profile_writes_rank_zeros_shape(checkpoints, tmp_path) -> None:  # noqa: ANN001
    """The command end to end (its own width by default on the CPU, the layer alone, a short budget):
    the profile's shape is rank 0's, so the cost model matches it to that rank."""
    import json

    from typer.testing import CliRunner

    from tessel.cli import app

    path, out = checkpoints("llama_linear_mha"), tmp_path / "p.json"
    args = ["profile", "--model", str(path), "--tensor-parallel-size", "2", "--components", "layer"]
    result = CliRunner().invoke(app, [*args, "--budget-s", "3", "--max-offset", "64", "--json", str(out)])
    assert result.exit_code == 0, result.output
    rank = TPSplit.of(ModelConfig.from_dir(path), 2).shards[0]
    shape = json.loads(out.read_text())["model_shape"]
    assert (shape["num_heads"], shape["num_kv_heads"], shape["intermediate_size"]) == (
        rank.num_heads,
        rank.num_kv_heads,
        rank.intermediate_size,
    )


def test_profile_refuses_a_degree_without_the_checkpoint(tmp_path) -> None:  # noqa: ANN001
    args = ["profile", "--tiny-shape", "64,128,4,2", "--tensor-parallel-size", "2"]
    message = user_error([*args, "--json", tmp_path / "p.json"])
    assert "model directory" in message and not (tmp_path / "p.json").exists()


def test_profile_refuses_a_degree_at_a_scaled_width(checkpoints, tmp_path) -> None:  # noqa: ANN001
    args = ["profile", "--model", checkpoints("llama"), "--scale", "2", "--tensor-parallel-size", "2"]
    message = user_error([*args, "--json", tmp_path / "p.json"])
    assert "no --scale other than 1" in message and not (tmp_path / "p.json").exists()
