"""One pipeline stage process, from loading to serving (`python -m tessel.pipeline.stage.worker`
starts its heartbeat, then runs `run_stage_process` here).

It reads the torchrun variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK), so it runs
under `torchrun --nnodes ... -m tessel.pipeline.stage.worker --plan P --model DIR ...` as well as
under `tessel launch` and `tessel serve --plan`, which spawn one per stage on this machine with their
`RunOptions` in a JSON file (`--options FILE`). Rank 0 runs the engine (`LLMEngine` on a
`ProcessExecutor`): it reads the requests, prints the outputs and writes `RunOptions.outputs`. Every
other rank loads its layers and serves micro-batches until stage 0 says stop (`tessel.pipeline.stage
.loop`).

With `TESSEL_RUN_DIR` set (the launchers set it), each stage writes `stage<k>.json` there: its
layers, weight bytes and resident memory once loaded, its compute time at the end, or the error
that stopped it; and its heartbeat (`tessel.pipeline.supervision.heartbeat`) carries its phase:
loading, joining, serving.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist

from tessel.engine.emulation import SlowDevice
from tessel.engine.engine_config import DEFAULT_MAX_NUM_BATCHED_TOKENS, EngineConfig
from tessel.engine.llm_engine import LLM, max_model_len
from tessel.engine.model_runner import kv_cache_bytes_per_block
from tessel.engine.sampling_params import SamplingParams
from tessel.errors import TesselError
from tessel.layers.linear import pack_linears
from tessel.layers.linear.tuning import tune_linears
from tessel.models.config import ModelConfig, resolve_dtype
from tessel.pipeline.checks import check_run, run_requests
from tessel.pipeline.comm.group import join_pipeline
from tessel.pipeline.comm.handshake import agree_flow_blocks, agree_kv_layout
from tessel.pipeline.comm.links import StageComm
from tessel.pipeline.comm.messages import PeerLostError
from tessel.pipeline.devices import TRANSPORTS, stage_device
from tessel.pipeline.executor import ProcessExecutor, layer_filter, stage_kv_budget
from tessel.pipeline.flow import FlowBlocks, flow_max_seqs, plan_paths
from tessel.pipeline.options import RunOptions
from tessel.pipeline.prompts_file import RunRequest
from tessel.pipeline.run_plan import RunPlan
from tessel.pipeline.stage.loop import serve_stage
from tessel.pipeline.stage.runner import StageRunner, rss_bytes
from tessel.pipeline.supervision.heartbeat import MASTER_LISTEN_FD_ENV, RUN_DIR_ENV, Heartbeat
from tessel.ports import inherited
from tessel.server.limits import DEFAULT_MAX_PROMPT_CHARS

T = TypeVar("T")
EXIT_PEER_LOST = 3
EXIT_FAILED = 1


def parser() -> argparse.ArgumentParser:
    """The command line of a stage started by hand (torchrun): the options `RunOptions` holds."""
    p = argparse.ArgumentParser(
        prog="python -m tessel.pipeline.stage.worker", description=__doc__.split("\n")[0]
    )
    p.add_argument("--options", type=Path, help="a RunOptions JSON file (what the launchers write)")
    p.add_argument("--plan", type=Path)
    p.add_argument("--model", type=Path)
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
    p.add_argument("--cpp-min-tokens", type=int, default=RunOptions.cpp_min_tokens)
    p.add_argument("--no-cpp", action="store_true", help="never cut prompts into CPP chunks")
    p.add_argument("--profile", type=Path, action="append", default=[], help="tessel profile JSON")
    p.add_argument("--threads", type=int, default=1, help="torch threads per stage")
    p.add_argument("--replica", type=int, help="which pipeline of a replica plan to run")
    p.add_argument("--transport", choices=TRANSPORTS, default="auto", help="how the stream crosses links")
    p.add_argument("--quiet", action="store_true", help="do not print the completions")
    p.add_argument("--warmup", action="store_true", help="first one untimed request per prompt length")
    return p


def options_from_argv(argv: list[str] | None) -> RunOptions:
    """The run's options: the `--options` file a launcher wrote, or the command line's."""
    args = parser().parse_args(argv)
    if args.options is not None:
        return RunOptions.read(args.options)
    if args.plan is None or args.model is None:
        raise TesselError("give --options FILE, or --plan PLAN and --model DIR")
    return RunOptions(
        args.plan, args.model, prompts=args.prompt, prompts_file=args.prompts_file,
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, ignore_eos=args.ignore_eos, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, kv_cache_gib=args.kv_cache_gib,
        preemption_mode=args.preemption_mode, host_kv_cache_gib=args.host_kv_cache_gib,
        emulate_host_gbps=args.emulate_host_gbps, max_num_batched_tokens=args.max_num_batched_tokens,
        micro_batches=args.micro_batches, cpp=not args.no_cpp, cpp_min_tokens=args.cpp_min_tokens,
        profiles=args.profile, threads=args.threads, warmup=args.warmup, replica=args.replica,
        max_prompt_chars=args.max_prompt_chars, transport=args.transport, outputs=args.json, quiet=args.quiet,
    )  # fmt: skip


def _run_dir() -> Path | None:
    """The launcher's run directory (None under torchrun without one)."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    return Path(run_dir) if run_dir else None


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


# ---- stage 0: the engine ------------------------------------------------------------------------------
def inherited_listener() -> socket.socket | None:
    """The socket on MASTER_PORT that `tessel launch` bound and passed down, if it did."""
    fd = os.environ.pop(MASTER_LISTEN_FD_ENV, None)  # popped: not passed on to this stage's children
    return None if fd is None else inherited(int(fd))


def run_first_stage(options: RunOptions, heartbeat: Heartbeat | None) -> None:
    requests = run_requests(options)
    executor = ProcessExecutor(options, listener=inherited_listener())
    executor.on_phase = lambda phase: _enter(heartbeat, phase)
    engine = LLM(options.model, executor=executor, **options.engine_kwargs())
    _enter(heartbeat, "serving")
    if heartbeat is not None and executor.comm is not None:
        heartbeat.progress = executor.comm.progress
    results, wall_s, _ = serve_requests(options, engine, requests, engine.shutdown)
    if options.outputs is not None:
        options.outputs.write_text(json.dumps({"wall_s": wall_s, "requests": results}, indent=1))
    if not options.quiet:
        for result in results:
            print(result["text"])
            print(f"({result['num_output_tokens']} tokens, finish_reason={result['finish_reason']})")


def serve_requests(
    options: RunOptions, engine: LLM, requests: list[RunRequest], finish: Callable[[], T]
) -> tuple[list[dict], float, T]:
    """Stage 0's run of a launch's requests (after the optional warm-up), then `finish()` (stopping
    the pipeline); its status written (`stage0.json`) -> (per request results, wall seconds of the
    timed requests, what `finish` returned)."""
    executor = engine.executor
    if options.warmup and engine.runner.cuda_graphs is not None:
        engine.warm_up()  # the GEMM tiles tuned and every bucket's graph captured, before timing
    stage0 = executor.stage
    report_loaded(0, executor.plan, stage0.weight_bytes, executor.rss_before_load_bytes, executor.kv_blocks)
    if options.warmup:
        warm_up(engine, requests)
        engine.count_from_here()  # every stage counts the timed requests only
    started, cpu_started = time.time(), time.process_time()
    finished = False
    try:
        outputs = engine.generate(
            [r.prompt for r in requests], [r.params for r in requests], use_progress=False
        )
        wall_s = time.time() - started
        finished, ended = True, finish()
    finally:
        if not finished:
            engine.shutdown()
    executor.stage.stats.process_cpu_s = time.process_time() - cpu_started
    kv = engine.preemption_stats  # by mode, and the bytes swapped out and back (tessel.engine.preemption)
    per_path = engine.scheduler.requests_per_path  # in the plan's path order
    write_status(
        0, **asdict(executor.stage.stats), wall_s=wall_s, preemptions=engine.scheduler.num_preemptions,
        kv_swaps=kv.swaps, kv_recomputes=kv.recomputes, kv_swap_bytes=kv.bytes_to_host + kv.bytes_to_device,
        path_requests={str(p.index): n for p, n in zip(executor.paths, per_path, strict=True)},
        overlapped_batches=executor.num_overlapped,
    )  # fmt: skip
    return [_result(out) for out in outputs], wall_s, ended


def warm_up(engine: LLM, requests: list[RunRequest]) -> None:
    """One short request per distinct prompt length, of random token ids (so the prefix cache
    cannot serve the real prompts): every stage builds its kernels for these shapes untimed."""
    generator = torch.Generator().manual_seed(0)
    lengths = sorted({len(engine.tokenize(r.prompt)) for r in requests})
    vocab = engine.model_config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    engine.generate(prompts, params, use_progress=False)


def _result(out) -> dict:  # noqa: ANN001 (RequestOutput)
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


# ---- the other stages ---------------------------------------------------------------------------------
def load_later_stage(options: RunOptions, plan: RunPlan, rank: int) -> tuple[StageRunner, int]:
    """Stage `rank`'s layers from the checkpoint, before it joins the process group (so a pipeline
    built beside a serving one loads while the old one serves); -> the runner and the resident
    memory before loading. Its status says `state: loaded`."""
    config = ModelConfig.from_dir(options.model)
    dtype = resolve_dtype(options.dtype, config)
    part = layer_filter(plan, rank, config.tie_word_embeddings)
    rss_before = rss_bytes()
    stage = plan.stages[rank]
    device = torch.device(stage_device(stage))
    slow = SlowDevice(stage.emulate_speed, stage.emulate_schedule)
    gpus = list(stage.tp_gpus) if stage.tp_gpus is not None else None
    runner = StageRunner.load(
        options.model,
        part,
        dtype,
        device,
        slow,
        stage.quantized_layers,
        stage.tp_degree,
        gpus,
        _run_dir(),
        rank,
    )
    runner.host_gbps = stage.emulate_host_gbps  # a CPU stage's emulated host link for streamed layers
    runner.kv_host_gbps = options.emulate_host_gbps or stage.emulate_host_gbps  # and for swapped KV
    if EngineConfig(**options.engine_kwargs()).pack_cpu_linears and device.type == "cpu":
        pack_linears(runner.model)  # now, not after joining (its `ModelRunner` then finds them packed)
    write_status(rank, state="loaded", pid=os.getpid())
    return runner, rss_before


def run_later_stage(
    options: RunOptions, plan: RunPlan, comm: StageComm, rank: int, loaded: tuple[StageRunner, int]
) -> None:
    config = ModelConfig.from_dir(options.model)
    dtype = resolve_dtype(options.dtype, config)
    runner, rss_before = loaded
    capacity = _capacity(options, plan, rank, runner.model, dtype, config)
    layout = agree_kv_layout(capacity, None)
    paths = plan_paths(plan, options.micro_batches)
    if len(paths) == 1:
        blocks = FlowBlocks([(0, layout.num_blocks)], layout.num_blocks, None, layout.block_size)
    else:  # its pool holds the block ranges of the paths through it
        blocks = agree_flow_blocks(paths, rank, capacity, layout)
    layout.num_blocks = blocks.local_blocks
    runner.attach_kv(layout, dtype, comm.device)
    if options.warmup and runner.runner.cuda_graphs is not None:
        max_rows = options.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, layout.max_model_len)
        tune_linears(runner.model, max_rows, dtype)
        runner.runner.cuda_graphs.capture_all()
    report_loaded(rank, plan, runner.weight_bytes, rss_before, layout.num_blocks)
    try:
        serve_stage(comm, runner, blocks)
    finally:
        runner.stop_tp()
    write_status(rank, **asdict(runner.stats))


def _capacity(options: RunOptions, plan: RunPlan, rank: int, model, dtype, config: ModelConfig) -> int:  # noqa: ANN001
    """The KV blocks this stage's own budget holds, at stage 0's block size and limits (the engine's
    defaults where the options leave them)."""
    engine = EngineConfig(**options.engine_kwargs())
    bs = engine.block_size
    per_block = kv_cache_bytes_per_block(model, bs, dtype)
    budget = stage_kv_budget(plan, rank, options.kv_cache_gib)
    max_seqs = flow_max_seqs(plan_paths(plan, options.micro_batches), engine.max_num_seqs)
    return budget.blocks(per_block, -(-max_model_len(engine, config) // bs), max_seqs)


def report_loaded(rank: int, plan: RunPlan, weight_bytes: int, rss_before_load: int, kv_blocks: int) -> None:
    """Status once loaded: `rss_bytes` is the whole process, `load_rss_bytes` what loading the
    stage's weights and KV blocks added to it (rank 0's at `tp_degree` > 1), `kv_blocks` the blocks
    of its own pool."""
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
        tp_degree=stage.tp_degree,
    )


# ---- the process ---------------------------------------------------------------------------------
def _enter(heartbeat: Heartbeat | None, phase: str) -> None:
    if heartbeat is not None:
        heartbeat.progress.phase, heartbeat.progress.phase_since = phase, time.time()


def run_stage_process(argv: list[str] | None, heartbeat: Heartbeat | None) -> int:
    """The stage's life after its heartbeat started (`tessel.pipeline.stage.worker.main`): check, load
    its layers, join the process group, serve; the phase of each step goes into its heartbeat."""
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    try:
        options = options_from_argv(argv)
        _enter(heartbeat, "loading")
        plan, model_config = check_run(options, world_size, rank)
        torch.set_num_threads(options.threads)
        if rank == 0:
            run_first_stage(options, heartbeat)
        else:
            loaded = load_later_stage(options, plan, rank)  # load first, then join
            _enter(heartbeat, "joining")
            dtype = resolve_dtype(options.dtype, model_config)
            comm = join_pipeline(plan, rank, options.transport, dtype, None, options.micro_batches)
            if heartbeat is not None:
                heartbeat.progress = comm.progress  # the heartbeat reports the stage's messages
            _enter(heartbeat, "serving")
            run_later_stage(options, plan, comm, rank, loaded)
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
