"""A flow plan (plan file v4, paths sharing placements) on the pipeline runtime: one process per
placement, requests routed over the paths by the flow weights, outputs equal to HF transformers'."""

from __future__ import annotations

import json

import pytest

from hf_oracle import hf_greedy
from pipeline_plans import write_flow_plan
from tessel.errors import TesselError
from tessel.pipeline.flow import FlowBlocks, path_block_ranges, share_micro_batches
from tessel.pipeline.run_plan import load_run_plan

PROMPTS = [
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a small model",
    "Paged attention stores keys and values in blocks.",
    "Digits 12345 and punctuation!",
]


# X holds layers 0-1 and feeds Y and Z (2-5); W (0-1) feeds Y too: a shared first placement (X), a
# shared last one (Y), and a path (W -> Y) that does not start where the scheduler runs.
PLACEMENTS = {
    "localhost/cpu0": (0, 2),
    "localhost/cpu1": (2, 6),
    "localhost/cpu2": (2, 6),
    "localhost/cpu3": (0, 2),
}
PATHS = [
    (["localhost/cpu0", "localhost/cpu1"], 0.5, 2),
    (["localhost/cpu0", "localhost/cpu2"], 0.3, 1),
    (["localhost/cpu3", "localhost/cpu1"], 0.2, 1),
]


def test_the_runtime_reads_a_flow_plan_as_placements_and_paths(tiny_dirs, tmp_path) -> None:
    plan_path = write_flow_plan(tmp_path / "flow.json", tiny_dirs["untied"], PLACEMENTS, PATHS)
    plan = load_run_plan(plan_path)
    assert [s.device for s in plan.stages] == [
        "localhost/cpu0", "localhost/cpu3", "localhost/cpu1", "localhost/cpu2"
    ]  # fmt: skip
    assert [p.ranks for p in plan.paths] == [(0, 2), (0, 3), (1, 2)]
    assert plan.micro_batches == 4
    slots = [p.micro_batches for p in share_micro_batches(plan.paths, 7)]  # 7 x weights: 3.5, 2.1, 1.4
    assert sum(slots) == 7 and all(abs(n - 7 * p.weight) < 1 for n, p in zip(slots, plan.paths, strict=True))
    with pytest.raises(TesselError, match="one path cannot run alone"):
        load_run_plan(plan_path, replica=1)
    skewed = [(d, w * 1.1, s) for d, w, s in PATHS]
    bad = write_flow_plan(tmp_path / "bad.json", tiny_dirs["untied"], PLACEMENTS, skewed)
    with pytest.raises(TesselError, match="sum to"):
        load_run_plan(bad)


def test_each_path_gets_the_blocks_its_placements_shares_hold(tiny_dirs, tmp_path) -> None:
    """Path block ranges against a hand count, and a placement's view of them: its pool is its paths'
    ranges back to back, and block ids in the metadata map to its own."""
    import torch

    from tessel.layers.attention import AttentionMetadata, DecodeGroup, PrefillChunk

    plan_path = write_flow_plan(tmp_path / "flow.json", tiny_dirs["untied"], PLACEMENTS, PATHS)
    paths = load_run_plan(plan_path).paths
    # ranks: X 0, W 1, Y 2, Z 3; shares by weight: X 5/8 and 3/8, Y 5/7 and 2/7, Z and W all
    capacities = [80, 100, 70, 40]
    ranges = path_block_ranges(paths, capacities, blocks_per_seq=4, max_num_seqs=100)
    # path 0: min(80 x 5/8, 70 x 5/7); path 1: min(80 x 3/8, 40); path 2: min(100, 70 x 2/7)
    assert ranges == [(0, 50), (50, 80), (80, 100)]
    capped = path_block_ranges(paths, capacities, 4, max_num_seqs=3)  # slots x 3 sequences x 4 blocks
    assert capped == [(0, 24), (24, 36), (36, 48)]
    with pytest.raises(TesselError, match="flow path 2: its share of placement 2"):
        path_block_ranges(paths, capacities, blocks_per_seq=21, max_num_seqs=100)
    assert FlowBlocks.for_rank(paths, ranges, 0, 16).local_of is None  # rank 0: ids 0..79, as they are
    y = FlowBlocks.for_rank(paths, ranges, 2, 16)  # paths 0 and 2: global 0..49 and 80..99
    assert y.local_blocks == 70
    table = torch.tensor([[3, 85, 0], [99, 0, 0]], dtype=torch.int32)
    meta = AttentionMetadata(
        torch.tensor([3 * 16 + 5, 85 * 16 + 15, -1]), 2,
        [DecodeGroup(0, 2, table, torch.tensor([20, 3], dtype=torch.int32))],
        [PrefillChunk(2, 1, 30, torch.tensor([81, 82]))],
    )  # fmt: skip
    local = y.local_meta(meta)
    assert local.slot_mapping.tolist() == [3 * 16 + 5, 55 * 16 + 15, -1]
    assert local.decode_groups[0].block_tables.tolist() == [[3, 55, 0], [69, 0, 0]]
    assert local.decode_groups[0].block_tables.dtype == torch.int32
    assert local.prefills[0].block_table.tolist() == [51, 52]


def test_flow_plan_launch_matches_hf_and_splits_requests_by_weight(tiny_dirs, tmp_path) -> None:
    """Four placement processes, three paths; 10 greedy requests (half with a shared prefix of
    several KV blocks) and a seeded one: each greedy one equals HF transformers' greedy continuation,
    the seeded one the single-process engine's; each path gets within one of weight x 11 requests,
    each placement loaded its layers once and W, Y and Z each ran micro-batches."""
    from tessel import LLM, SamplingParams
    from tessel.engine.llm_engine import load_tokenizer
    from tessel.models.layer_filter import LayerFilter
    from tessel.models.loader import load_model
    from tessel.pipeline.run import RunOptions, run_pipeline
    from tessel.pipeline.stage.runner import tensor_bytes

    model = tiny_dirs["untied"]
    plan_path = write_flow_plan(tmp_path / "flow.json", model, PLACEMENTS, PATHS)
    # a shared prefix of several KV blocks: a block one path computed must not serve another's request
    prefix = "Paged attention stores keys and values in blocks of sixteen tokens. " * 3
    prompts = [(prefix if i % 2 else "") + PROMPTS[i % len(PROMPTS)] + f" {i}" for i in range(10)]
    lines = [{"prompt": p, "max_tokens": 6} for p in prompts]
    lines.append({"prompt": PROMPTS[1], "temperature": 0.8, "top_k": 30, "seed": 5, "max_tokens": 6})
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    options = RunOptions(plan_path, model, prompts_file=requests, ignore_eos=True, max_num_seqs=1)
    run = run_pipeline(options)
    tokenizer = load_tokenizer(model)
    for prompt, result in zip(prompts, run.requests[:-1], strict=True):
        ids = list(tokenizer(prompt)["input_ids"])
        assert result["token_ids"] == hf_greedy(model, ids, 6, ignore_eos=True), prompt
    # the seeded request samples on its path's last placement as one process samples it
    seeded = SamplingParams(temperature=0.8, top_k=30, seed=5, max_tokens=6, ignore_eos=True)
    one_process = LLM(model).generate([PROMPTS[1]], seeded, use_progress=False)[0]
    assert run.requests[-1]["token_ids"] == one_process.token_ids
    assert len(run.stages) == 4 and [s["state"] for s in run.stages] == ["done"] * 4
    split = run.stages[0]["path_requests"]
    assert sum(split.values()) == 11
    assert all(abs(split[str(i)] - w * 11) < 1 for i, (_, w, _) in enumerate(PATHS)), split
    # each placement's process holds its range once: its weights are one load of that range
    import torch

    for status, (device, (a, b)) in zip(run.stages, [(d, PLACEMENTS[d]) for d in
                                                     ["localhost/cpu0", "localhost/cpu3", "localhost/cpu1",
                                                      "localhost/cpu2"]], strict=True):  # fmt: skip
        assert (status["layer_start"], status["layer_end"]) == (a, b), device
        part = LayerFilter(a, b, embed=a == 0, head=b == 6, tied=False)
        assert status["weight_bytes"] == tensor_bytes(load_model(model, torch.float32, "cpu", layers=part))
    assert all(s["batches"] > 0 for s in run.stages[1:])  # W, Y and Z each ran micro-batches
    # each pool holds the block ranges of the paths through it: X paths 0+1, W 2, Y 0+2, Z 1
    x, w, y, z = (s["kv_blocks"] for s in run.stages)
    assert y == x - z + w and z < x and w < y
