"""One pipeline stage process: `python -m tessel.pipeline.worker --plan plan.json --model DIR ...`.

It reads the torchrun variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), so it
runs under `torchrun --nnodes ... -m tessel.pipeline.worker` as well as under `tessel launch`, which
spawns one per stage on this machine. Rank 0 is stage 0: it reads the requests, runs the
scheduler (`PipelineEngine`), prints the outputs and writes `--json`. Every other rank loads its
layers and serves micro-batches until stage 0 says stop.

With `TESSEL_RUN_DIR` set (the launcher sets it), each stage writes `stage<k>.json` there: its
layers, weight bytes and resident memory once loaded, its compute time at the end, or the error
that stopped it; and a heartbeat thread rewrites `stage<k>.beat` with its progress
(`tessel.pipeline.heartbeat`), from the start of `main` to the process's end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from tessel.engine.engine_config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from tessel.engine.limits import MAX_TORCH_THREADS
from tessel.engine.llm_engine import max_model_len
from tessel.engine.model_runner import kv_cache_bytes_per_block
from tessel.engine.sampling_params import SamplingParams
from tessel.errors import TesselError
from tessel.layers.linear import pack_linears
from tessel.layers.linear.tuning import tune_linears
from tessel.models.config import ModelConfig, resolve_dtype
from tessel.models.reader import read_model
from tessel.pipeline.chunk_cutter import DEFAULT_CPP_MIN_TOKENS, ChunkCutter
from tessel.pipeline.comm import PeerLostError, StageComm, agree_kv_layout
from tessel.pipeline.devices import (
    TRANSPORTS,
    check_devices,
    cuda_devices,
    link_transports,
    process_group_backend,
    stage_device,
)
from tessel.pipeline.driver import PipelineEngine, layer_filter, stage_kv_budget
from tessel.pipeline.heartbeat import Heartbeat, Progress, beat_interval_s, heartbeat_timeout_s
from tessel.pipeline.prompts_file import RunRequest, read_requests
from tessel.pipeline.request_checks import check_prompt_chars
from tessel.pipeline.run_plan import RunPlan, load_run_plan, priced_pipeline
from tessel.pipeline.stage import StageExecutor, StageStats, rss_bytes
from tessel.pipeline.weight_stream import check_offload
from tessel.plan.workload import MAX_MICRO_BATCHES
from tessel.server.limits import DEFAULT_MAX_PROMPT_CHARS

RUN_DIR_ENV = "TESSEL_RUN_DIR"
# Idle stages wait for work without limit (a server may idle for hours); a dead peer is noticed
# by its closed connection and by the launcher, not by this timeout.
COMM_TIMEOUT = timedelta(days=7)
EXIT_PEER_LOST = 3
EXIT_FAILED = 1


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tessel.pipeline.worker", description=__doc__.split("\n")[0])
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--prompt", action="append", default=[])
    p.add_argument("--prompts-file", type=Path)
    p.add_argument(
        "--max-prompt-chars", type=int, default=DEFAULT_MAX_PROMPT_CHARS, help="longest text prompt"
    )
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", type=Path, help="write per request token_ids, text and timings")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-num-seqs", type=int)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--kv-cache-gib", type=float)
    p.add_argument("--preemption-mode", choices=("auto", "swap", "recompute"), default="auto")
    p.add_argument("--host-kv-cache-gib", type=float)
    p.add_argument("--emulate-host-gbps", type=float, help="emulated host link for KV swaps, Gbit/s")
    p.add_argument("--max-num-batched-tokens", type=int)
    p.add_argument("--micro-batches", type=int, help="micro-batches in flight (default: the plan's m)")
    p.add_argument("--cpp-min-tokens", type=int, default=DEFAULT_CPP_MIN_TOKENS)
    p.add_argument("--no-cpp", action="store_true", help="never cut prompts into CPP chunks")
    p.add_argument("--profile", type=Path, action="append", default=[], help="tessel profile JSON")
    p.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    p.add_argument("--replica", type=int, help="which pipeline of a replica plan to run")
    p.add_argument(
        "--transport",
        choices=TRANSPORTS,
        default="auto",
        help="how the stream crosses links: auto (NCCL between two GPUs, else pinned host buffers), or one",
    )
    p.add_argument("--quiet", action="store_true", help="do not print the completions")
    p.add_argument(
        "--warmup",
        action="store_true",
        help="first run one untimed request per prompt length (random tokens)",
    )
    return p


def engine_kwargs(args: argparse.Namespace) -> dict:
    options = {
        "dtype": args.dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": args.max_model_len,
        "kv_cache_gib": args.kv_cache_gib,
        "preemption_mode": args.preemption_mode,
        "host_kv_cache_gib": args.host_kv_cache_gib,
        "emulate_host_gbps": args.emulate_host_gbps,
        "max_num_batched_tokens": args.max_num_batched_tokens,
    }
    return {key: value for key, value in options.items() if value is not None}


def validate(
    args: argparse.Namespace, world_size: int | None = None, rank: int | None = None
) -> tuple[RunPlan, ModelConfig]:
    """Everything checkable before a process starts: the plan against the model, the world and this
    machine's devices (every stage's; under torchrun, `rank`'s own)."""
    if not args.model.is_dir():
        raise TesselError(
            f"--model {args.model} is not a directory; give a local Hugging Face model directory"
        )
    plan = load_run_plan(args.plan, args.replica)
    config = read_model(args.model).config  # the one model reader: config and weights agree
    plan.check_model(args.model.resolve().name, config.num_hidden_layers)
    if world_size is not None and world_size != len(plan.stages):
        raise TesselError(f"WORLD_SIZE is {world_size} but the plan has {len(plan.stages)} stages")
    for name, most in (("micro_batches", MAX_MICRO_BATCHES), ("threads", MAX_TORCH_THREADS)):
        value = getattr(args, name)
        if value is not None and not 1 <= value <= most:
            raise TesselError(f"--{name.replace('_', '-')} must be in [1, {most}], got {value}")
    if plan.paths and args.transport == "nccl":
        raise TesselError("--transport nccl: a flow plan's placements pass micro-batches over gloo (host)")
    link_transports(plan, args.transport)
    check_devices(plan, cuda_devices(), None if rank is None else [rank])
    check_offload(plan.stages, config, resolve_dtype(args.dtype, config), None if rank is None else [rank])
    if args.cpp_min_tokens < 1:
        raise TesselError(f"--cpp-min-tokens must be >= 1, got {args.cpp_min_tokens}")
    return plan, config


def run_requests(args: argparse.Namespace) -> list[RunRequest]:
    defaults = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    requests = [RunRequest(p, defaults, f"--prompt {i + 1}") for i, p in enumerate(args.prompt)]
    if args.prompts_file is not None:
        requests += read_requests(args.prompts_file, defaults)
    if not requests:
        raise TesselError("give at least one --prompt or a --prompts-file")
    check_prompt_chars(requests, args.max_prompt_chars)
    return requests


def device_for(plan: RunPlan, rank: int) -> torch.device:
    """The stage's torch device, from the plan (`tessel.pipeline.devices.stage_device`)."""
    return torch.device(stage_device(plan.stages[rank]))


def join_pipeline(
    plan: RunPlan, rank: int, transport: str, dtype: torch.dtype, init_method: str | None = None
) -> StageComm:
    """Join the stages' process group (gloo, plus NCCL where a link runs GPU to GPU) -> the stage's
    links."""
    device = device_for(plan, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    transports = [] if plan.paths else link_transports(plan, transport)  # a flow plan's: gloo, host
    dist.init_process_group(
        process_group_backend(transports),
        init_method=init_method,
        rank=rank,
        world_size=len(plan.stages),
        timeout=COMM_TIMEOUT,
    )
    if plan.paths:
        from tessel.pipeline.flow_routing import FlowComm

        return FlowComm(plan.paths, rank, len(plan.stages), device, dtype)
    world_size = len(plan.stages)
    token_group = None
    if world_size > 1:  # every rank takes part in making it; stage 0 receives tokens on a thread
        token_group = dist.new_group([0, world_size - 1], timeout=COMM_TIMEOUT, backend="gloo")
    return StageComm(rank, world_size, device, dtype, transports, token_group)


def write_status(rank: int, **fields) -> None:
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    path = Path(run_dir) / f"stage{rank}.json"
    status = json.loads(path.read_text()) if path.is_file() else {"stage": rank}
    status.update(fields)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(status))
    tmp.replace(path)


# ---- the stages ------------------------------------------------------------------------------------
def run_first_stage(args: argparse.Namespace, plan: RunPlan, comm: StageComm | None) -> None:
    requests = run_requests(args)
    cutter, engine_class = None, PipelineEngine
    if not args.no_cpp and len(plan.stages) > 1 and not plan.paths:
        cutter = ChunkCutter(priced_pipeline(plan, args.profile), args.cpp_min_tokens)
    if plan.paths:
        from tessel.pipeline.flow_routing import FlowPipelineEngine as engine_class
    engine = engine_class(
        args.model, plan, comm, micro_batches=args.micro_batches, cutter=cutter, **engine_kwargs(args)
    )
    if args.warmup and engine.runner.cuda_graphs is not None:
        engine.warm_up()  # the GEMM tiles tuned and every bucket's graph captured, before timing
    kv_blocks = engine._flow_blocks.local_blocks if plan.paths else engine.num_total_blocks  # its own pool
    report_loaded(0, plan, engine.stage.weight_bytes, engine.rss_before_load_bytes, kv_blocks)
    if args.warmup:
        warm_up(engine, requests)
        engine.count_from_here()  # every stage counts the timed requests only
    started, cpu_started = time.time(), time.process_time()
    try:
        outputs = engine.generate(
            [r.prompt for r in requests], [r.params for r in requests], use_progress=False
        )
    finally:
        engine.shutdown()
    wall_s = time.time() - started
    engine.stage.stats.process_cpu_s = time.process_time() - cpu_started
    kv = engine.preemption_stats  # by mode, and the bytes swapped out and back (tessel.engine.preemption)
    write_status(
        0, **asdict(engine.stage.stats), wall_s=wall_s, preemptions=engine.scheduler.num_preemptions,
        kv_swaps=kv.swaps, kv_recomputes=kv.recomputes, kv_swap_bytes=kv.bytes_to_host + kv.bytes_to_device,
    )  # fmt: skip
    if plan.paths:  # requests per path, in the plan's path order
        counts = engine.requests_per_path
        write_status(0, path_requests={str(p.index): n for p, n in zip(plan.paths, counts, strict=True)})
    results = [_result(out) for out in outputs]
    if args.json is not None:
        args.json.write_text(json.dumps({"wall_s": wall_s, "requests": results}, indent=1))
    if not args.quiet:
        for result in results:
            print(result["text"])
            print(f"({result['num_output_tokens']} tokens, finish_reason={result['finish_reason']})")


def warm_up(engine: PipelineEngine, requests: list[RunRequest]) -> None:
    """One short request per distinct prompt length, of random token ids (so the prefix cache
    cannot serve the real prompts): every stage builds its kernels for these shapes untimed."""
    generator = torch.Generator().manual_seed(0)
    lengths = sorted({len(engine.tokenize(r.prompt)) for r in requests})
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.generate(prompts, params, use_progress=False)


def _result(out) -> dict:
    m = out.metrics
    ttft = None if m.first_token_time is None else m.first_token_time - m.arrival_time
    n = out.num_output_tokens
    tpot = None if n < 2 or m.finish_time is None else (m.finish_time - m.first_token_time) / (n - 1)
    return {
        "prompt": out.prompt,
        "token_ids": out.token_ids,
        "text": out.text,
        "finish_reason": out.finish_reason,
        "num_prompt_tokens": out.num_prompt_tokens,
        "num_output_tokens": n,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "arrival_time": m.arrival_time,
        "finish_time": m.finish_time,
    }


def load_later_stage(args: argparse.Namespace, plan: RunPlan, rank: int) -> tuple[StageExecutor, int]:
    """Stage `rank`'s layers from the checkpoint, before it joins the process group (so a pipeline
    built beside a serving one, `tessel.pipeline.remap`, loads while the old one serves); -> the
    executor and the resident memory before loading. Its status says `state: loaded`."""
    config = ModelConfig.from_dir(args.model)
    dtype = resolve_dtype(args.dtype, config)
    part = layer_filter(plan, rank, config.tie_word_embeddings)
    rss_before = rss_bytes()
    stage = plan.stages[rank]
    executor = StageExecutor.load(
        args.model,
        part,
        dtype,
        device_for(plan, rank),
        stage.emulate_speed,
        stage.quantized_layers,
        stage.emulate_schedule,
    )
    executor.host_gbps = stage.emulate_host_gbps  # a CPU stage's emulated host link for streamed layers
    executor.kv_host_gbps = args.emulate_host_gbps or stage.emulate_host_gbps  # and for swapped KV
    if EngineConfig(**engine_kwargs(args)).pack_cpu_linears and device_for(plan, rank).type == "cpu":
        pack_linears(executor.model)  # now, not after joining (its `ModelRunner` then finds them packed)
    write_status(rank, state="loaded", pid=os.getpid())
    return executor, rss_before


def run_later_stage(
    args: argparse.Namespace,
    plan: RunPlan,
    comm: StageComm,
    rank: int,
    loaded: tuple[StageExecutor, int] | None = None,
) -> None:
    config = ModelConfig.from_dir(args.model)
    dtype = resolve_dtype(args.dtype, config)
    executor, rss_before = loaded or load_later_stage(args, plan, rank)
    capacity = _capacity(args, plan, rank, executor.model, dtype, config)
    layout = agree_kv_layout(capacity, None)
    blocks = None
    if plan.paths:  # its pool holds the block ranges of the flow paths through it
        from dataclasses import replace

        from tessel.pipeline.flow_routing import agree_flow_blocks

        blocks = agree_flow_blocks(plan.paths, rank, capacity, layout)
        layout = replace(layout, num_blocks=blocks.local_blocks)
    executor.attach_kv(layout, dtype, comm.device)
    if args.warmup and executor.runner.cuda_graphs is not None:
        max_rows = args.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, layout.max_model_len)
        tune_linears(executor.model, max_rows, dtype)
        executor.runner.cuda_graphs.capture_all()
    report_loaded(rank, plan, executor.weight_bytes, rss_before, layout.num_blocks)
    if plan.paths:
        from tessel.pipeline.flow_routing import serve_flow_stage

        serve_flow_stage(comm, executor, blocks)
    else:
        serve_stage(comm, executor, last=rank == len(plan.stages) - 1)
    write_status(rank, **asdict(executor.stats))


def _capacity(args: argparse.Namespace, plan: RunPlan, rank: int, model, dtype, config: ModelConfig) -> int:
    """The KV blocks this stage's own budget holds, at stage 0's block size and limits (the engine's
    defaults where the options leave them)."""
    engine = EngineConfig(**engine_kwargs(args))
    bs = engine.block_size
    per_block = kv_cache_bytes_per_block(model, bs, dtype)
    budget = stage_kv_budget(plan, rank, args.kv_cache_gib)
    max_seqs = engine.max_num_seqs
    if plan.paths:
        from tessel.pipeline.flow_routing import flow_max_seqs, with_micro_batches

        paths = plan.paths
        if args.micro_batches is not None:
            paths = with_micro_batches(paths, args.micro_batches)
        max_seqs = flow_max_seqs(paths, max_seqs)
    return budget.blocks(per_block, -(-max_model_len(engine, config) // bs), max_seqs)


def serve_stage(comm: StageComm, executor: StageExecutor, last: bool) -> None:
    """Run micro-batches from the previous stage until stage 0 says stop."""
    executor.progress = comm.progress  # the heartbeat carries its batches and busy seconds
    serving_cpu = time.process_time()
    while (received := comm.recv_batch()) is not None:
        message, stream = received
        if message.fresh_stats:  # stage 0's warm-up is over: count from this batch
            executor.stats, serving_cpu = StageStats(), time.process_time()
        executor.adopt(message)
        started, cpu_started = time.perf_counter(), time.process_time()
        out = executor.runner.run_stage(message.positions, message.meta, stream=stream)
        sampled = executor.sample(out, message) if last else None  # tokens and the logprobs asked for
        executor.account(started, stream.shape[0], cpu_started)
        if last:
            comm.send_tokens(message.batch_id, sampled)
        else:
            comm.send_batch(message, out)
    comm.send_stop()
    comm.flush()
    executor.stats.process_cpu_s = time.process_time() - serving_cpu


def report_loaded(rank: int, plan: RunPlan, weight_bytes: int, rss_before_load: int, kv_blocks: int) -> None:
    """Status once loaded: `rss_bytes` is the whole process, `load_rss_bytes` what loading the
    stage's weights and KV blocks added to it, `kv_blocks` the blocks every stage agreed on."""
    stage = plan.stages[rank]
    rss = rss_bytes()
    write_status(
        rank,
        state="ready",
        pid=os.getpid(),
        layer_start=stage.layer_start,
        layer_end=stage.layer_end,
        weight_bytes=weight_bytes,
        rss_bytes=rss,
        load_rss_bytes=rss - rss_before_load,
        kv_blocks=kv_blocks,
        device=stage_device(stage),
    )


# ---- the process ---------------------------------------------------------------------------------
def start_heartbeat(rank: int) -> Heartbeat | None:
    """The stage's heartbeat thread, under a launcher (`TESSEL_RUN_DIR` set); None under torchrun."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return None
    return Heartbeat(Path(run_dir), rank, beat_interval_s(heartbeat_timeout_s()), Progress()).start()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        heartbeat = start_heartbeat(rank)
        plan, _ = validate(args, world_size, rank)
        torch.set_num_threads(args.threads)
        loaded = load_later_stage(args, plan, rank) if rank > 0 else None  # load first, then join
        comm = None
        if world_size > 1:
            dtype = resolve_dtype(args.dtype, ModelConfig.from_dir(args.model))
            comm = join_pipeline(plan, rank, args.transport, dtype)
            if heartbeat is not None:
                heartbeat.progress = comm.progress  # the heartbeat reports the stage's messages
        if rank == 0:
            run_first_stage(args, plan, comm)
        else:
            run_later_stage(args, plan, comm, rank, loaded)
        write_status(rank, state="done")
        return 0
    except KeyboardInterrupt:
        write_status(rank, state="interrupted")
        return 130
    except PeerLostError as error:
        write_status(rank, state="failed", kind="peer", error=str(error))
        print(f"tessel stage {rank}: {error}", file=sys.stderr)
        return EXIT_PEER_LOST
    except TesselError as error:
        write_status(rank, state="failed", kind="user", error=str(error))
        print(f"tessel stage {rank}: error: {error}", file=sys.stderr)
        return error.exit_code
    except BaseException as error:  # noqa: BLE001 - reported to the launcher, then re-raised as exit code
        cause = f"{type(error).__name__}: {error}"
        write_status(
            rank, state="failed", kind="exception", error=cause, traceback=traceback.format_exc()[-4000:]
        )
        print(f"tessel stage {rank} failed: {cause}", file=sys.stderr)
        traceback.print_exc()
        return EXIT_FAILED
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a dead peer may make this fail too
                pass


if __name__ == "__main__":
    sys.exit(main())
