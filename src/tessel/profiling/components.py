"""Time what the cost model prices besides the decoder layers, as the engine and the runtime run it.

    embed      `VocabEmbedding` of n token ids (the first stage's gather)
    head       final `RMSNorm` + `LMHead` (oneDNN-packed on CPU, as `ModelRunner` packs it) + the
               greedy sampler and the copy of the tokens to the host, for n rows
    step       the engine's per-step work outside the model: `LLMEngine.step` on a real checkpoint
               with B running sequences, minus the time of its model forward and its sampling
               (measured in the same step, so the load of the machine cancels)
    transport  one stage-to-stage message as `tessel.pipeline.comm` sends it (a 4-int64 header, a
               pickled metadata blob, the hidden-state tensor of n bytes), one way between two
               processes over gloo: half the round trip of a ping-pong ("host"; on CUDA the hidden
               states go through pinned host buffers, and GPU to GPU over NCCL for "nccl")

Each is fitted with its held-out error (`tessel.cost.fit.fit_component`): the step `t(x) = c0 + c1*x`;
the embedding, the head and the transport piecewise-linear through the measured sizes (the
embedding's cost per token changes once its rows leave the cache, the head's GEMM is a staircase in
its rows with the tile edges both timed and never held out, a message's fixed cost gives way to its
bytes past a few hundred KiB). The embedding, the head and the step are timed with the profile's
clock (process CPU time for one CPU thread; the step's subtraction is within one step); the
transport with wall time (a message's time is spent in two processes), in rounds of one ping-pong
per size. The step keeps the median of each size's fastest half (`clean_statistic`); the transport
each size's best round, as `tessel probe` takes a link's: a ping-pong on a loaded host waits
milliseconds for both processes to hold a core, which is the core sharing the cost model prices
apart (`core_share`), not the transport's own time. Each component is timed in its phase of the
profile's budget (`tessel.deadline`): its rounds stop at the phase's deadline, one at least.
"""

from __future__ import annotations

import math
import os
import pickle
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tessel.cost.fit import MIN_FIT_SIZES, fit_component, row_anchors
from tessel.cost.profile import ComponentFit, transport_key
from tessel.deadline import Deadline, Phases, spread_order
from tessel.errors import TesselError

EMBED_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024)
HEAD_ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 17, 24, 32, 33, 48, 49, 64)  # both sides of each GEMM tile edge
STEP_SEQUENCES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
STEP_PROMPT_TOKENS = 16
STEP_TIMED = 20  # decode steps timed per batch size (after one untimed; `clean_statistic` kept)
COMPONENT_MIN_REPEATS = 9  # rounds of timed runs of the embedding and head sizes
TRANSPORT_BYTES = tuple(2**k for k in range(8, 25))  # 256 B .. 16 MiB, every power of two
TRANSPORT_ROUNDS = 200  # ping-pongs per size (the best kept), fewer once the transport's deadline passes
UNTIMED_TRANSPORT_ROUNDS = 2
ENDS_EMBED_SHARE = 0.3  # of the ends' time: the gathers are cheap, the LM head's GEMMs are not
METADATA_BYTES = 2048  # the pickled BatchMessage of a small decode batch is of this order
HEADER_LEN = 4  # tessel.pipeline.comm.HEADER_LEN (not imported: that module needs torch.distributed)


@dataclass(frozen=True, slots=True)
class EndsShape:
    """The sizes the embedding and the LM head are timed at."""

    hidden_size: int
    vocab_size: int
    rms_norm_eps: float = 1e-5

    def as_dict(self) -> dict[str, int]:
        return {"hidden_size": self.hidden_size, "vocab_size": self.vocab_size}


def host_cores() -> int:
    """Cores this process may run on (its CPU affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def transports_for(device: str) -> tuple[str, ...]:
    """The transports the runtime uses between stages of this device kind here
    (`tessel.pipeline.devices.link_transport`): host buffers over gloo everywhere, NCCL between GPUs
    (profiled where this machine has two)."""
    if device == "cpu":
        return ("host",)
    import torch

    # NCCL joins two stages on two GPUs; stages sharing one GPU go through host buffers
    return ("host", "nccl") if torch.cuda.device_count() >= 2 else ("host",)


def _interleaved_medians(
    fns: list[Callable[[], object]], clock, settings, deadline: Deadline | None = None
) -> np.ndarray:
    """Median seconds of each of `fns`, timed in rounds of one run of each (a load change on a shared
    machine hits every size alike, so it shifts the fit less than it bends it), until `deadline`."""
    from tessel.profiling.timing import time_runs

    repeats = max(settings.repeats, COMPONENT_MIN_REPEATS)
    runs = time_runs(
        fns,
        clock,
        warmup=settings.warmup,
        repeats=repeats,
        min_total_s=settings.min_point_s,
        deadline=deadline,
    )
    return np.array([statistics.median(times) for times in runs], float)


def measure_ends(
    shape: EndsShape, settings, clock, deadline: Deadline | None = None
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(sizes, median seconds) of the embedding and of the head + sampling, keyed "embed" / "head";
    the embedding gets `ENDS_EMBED_SHARE` of the time `deadline` leaves, the head the rest."""
    import torch

    from tessel.layers.embedding import LMHead, VocabEmbedding
    from tessel.layers.linear import pack_linears
    from tessel.layers.norm import RMSNorm

    device = torch.device(settings.device)
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[settings.dtype]
    gen = torch.Generator(device="cpu").manual_seed(settings.seed)
    h, v = shape.hidden_size, shape.vocab_size
    weight = (torch.randn(v, h, generator=gen) / h**0.5).to(device, dtype)
    embed = VocabEmbedding(v, h).to(device, dtype)
    embed.weight = torch.nn.Parameter(weight, requires_grad=False)
    ends = torch.nn.Module()
    ends.norm = RMSNorm(h, shape.rms_norm_eps).to(device, dtype)
    ends.lm_head = LMHead(v, h).to(device, dtype)
    ends.lm_head.tie(embed)
    ends.requires_grad_(False)
    if device.type == "cpu":
        pack_linears(ends)  # ModelRunner packs the LM head the same way (a tied head gets its own copy)

    def embed_fn(n: int) -> Callable[[], object]:
        ids = torch.randint(0, v, (n,), generator=gen).to(device)
        return lambda: embed(ids)

    def head_fn(n: int) -> Callable[[], object]:
        hidden = torch.randn(n, h, generator=gen).to(device, dtype)
        residual = torch.randn(n, h, generator=gen).to(device, dtype)

        def head() -> list[int]:
            normed, _ = ends.norm(hidden, residual)
            return ends.lm_head(normed).float().argmax(dim=-1).tolist()  # ModelRunner.sample, greedy

        return head

    deadline = deadline if deadline is not None else Deadline(float("inf"))
    with torch.inference_mode():
        embed_deadline = deadline.share(ENDS_EMBED_SHARE)
        embed_s = _interleaved_medians([embed_fn(n) for n in EMBED_TOKENS], clock, settings, embed_deadline)
        head_s = _interleaved_medians([head_fn(n) for n in HEAD_ROWS], clock, settings, deadline)
    sizes = {"embed": np.array(EMBED_TOKENS, float), "head": np.array(HEAD_ROWS, float)}
    return sizes, {"embed": embed_s, "head": head_s}


def step_engine_eager(settings) -> bool:  # noqa: ANN001
    """Whether the step is timed on an eager engine: yes, but for a CUDA profile of graph replays
    (`--cuda-graphs`), whose engine prepares a step's inputs for the graph instead (measured on an
    H200: 0.14 ms outside the model per SmolLM2 step with graphs, 0.34 ms eager)."""
    return not (settings.device == "cuda" and getattr(settings, "cuda_graphs", False))


def time_model_calls(
    runner,
    read: Callable[[], float],
    cuda: bool,  # noqa: ANN001
) -> tuple[dict[str, float], Callable[[], None]]:
    """Wrap `runner`'s model forward and sampling so that each call adds its seconds (by `read`,
    synchronised before and after on CUDA) to the dict's "forward" and "sample" (the caller resets
    them) -> (that dict, a function that puts the originals back)."""
    import torch

    spent = {"forward": 0.0, "sample": 0.0}
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    originals = {"_forward": runner._forward, "sample_hidden": runner.sample_hidden}

    def timed(fn, key: str):  # noqa: ANN001, ANN202
        def wrapper(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            sync()
            begin = read()
            out = fn(*args, **kwargs)
            sync()
            spent[key] += read() - begin
            return out

        return wrapper

    def restore() -> None:
        for name, fn in originals.items():
            setattr(runner, name, fn)

    runner._forward = timed(originals["_forward"], "forward")
    runner.sample_hidden = timed(originals["sample_hidden"], "sample")
    return spent, restore


def measure_step_overhead(
    checkpoint: Path, settings, deadline: Deadline | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(sequences per step, seconds of the engine's step outside the model: `clean_statistic` of the
    timed steps) on `checkpoint`. Process CPU time under the profile's `cpu` clock (one thread: the
    model's time is its CPU time too), else wall time. The batch sizes run in `spread_order`, until
    `deadline` has passed and a fit has its `MIN_FIT_SIZES`."""
    from tessel.engine.llm_engine import LLMEngine
    from tessel.engine.sampling_params import SamplingParams

    most = max(STEP_SEQUENCES)
    tokens = STEP_PROMPT_TOKENS + STEP_TIMED + 2
    engine = LLMEngine(
        checkpoint,
        dtype={"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[settings.dtype],
        device=settings.device,
        max_num_seqs=most,
        max_model_len=tokens + 1,
        num_kv_blocks=most * (-(-(tokens + 1) // 16)) + 1,
        enable_prefix_caching=False,
        enforce_eager=step_engine_eager(settings),
    )
    read = time.process_time if settings.clock == "cpu" else time.perf_counter
    spent, _ = time_model_calls(engine.runner, read, settings.device == "cuda")  # for the engine's life
    vocab = engine.model_config.vocab_size
    rng = np.random.default_rng(settings.seed)
    sizes, medians = [], []
    params = SamplingParams(temperature=0.0, max_tokens=STEP_TIMED + 2, ignore_eos=True)
    for rank in spread_order(len(STEP_SEQUENCES)):
        if len(sizes) >= MIN_FIT_SIZES and deadline is not None and deadline.passed():
            break
        batch = sorted(STEP_SEQUENCES)[rank]
        for i in range(batch):
            prompt = [int(t) for t in rng.integers(100, vocab, STEP_PROMPT_TOKENS)]
            engine.add_request(f"b{batch}-{i}", prompt, params)
        engine.step()  # the prompts
        engine.step()  # first decode step (untimed)
        overheads = []
        for _ in range(STEP_TIMED):
            spent.update(forward=0.0, sample=0.0)
            begin = read()
            engine.step()
            overheads.append(max(read() - begin - spent["forward"] - spent["sample"], 1e-7))
        while engine.has_unfinished_requests():
            engine.step()
        sizes.append(batch)
        medians.append(clean_statistic(overheads))
    return np.array(sizes, float), np.array(medians, float)


def measure_transport(
    transport: str,
    settings,
    sizes: tuple[int, ...] = TRANSPORT_BYTES,
    rounds: int = TRANSPORT_ROUNDS,
    deadline: Deadline | None = None,
) -> tuple[np.ndarray, np.ndarray, int]:
    """(hidden-state bytes per message, best one-way seconds, timed rounds) between two processes of
    this host: `rounds` rounds, fewer once `deadline` has passed (one at least)."""
    import torch.multiprocessing as mp

    if transport not in transports_for(settings.device):
        raise TesselError(f"transport {transport!r} is not one the runtime uses on {settings.device}")
    # the rounds' end on this host's monotonic clock, which both processes read
    end_s = math.inf if deadline is None else time.monotonic() + deadline.left_s()
    context = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="tessel-transport-") as tmp:
        queue = context.SimpleQueue()
        store = str(Path(tmp) / "store")
        procs = [
            context.Process(
                target=_transport_worker,
                args=(rank, store, transport, settings.device, sizes, rounds, end_s, queue),
            )
            for rank in (0, 1)
        ]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join(timeout=300)
        failed = [proc.exitcode for proc in procs if proc.exitcode != 0]
        result = queue.get() if not queue.empty() else None
    if failed or not isinstance(result, list):
        raise TesselError(f"timing the {transport} transport between two processes failed (exit {failed})")
    sizes = np.array([n for n, _ in result], float)
    return sizes, np.array([min(times) for _, times in result], float), len(result[0][1])


def clean_statistic(times_s: list[float]) -> float:
    """One size's time from its runs: the median of the fastest half. On a shared host a run is clean
    or delayed by the others (a step's Python shares the core and its caches): delays only add, so
    the median of all is pulled towards them as the load rises, the fastest half's median stays at
    the clean mode. On a quiet host the runs agree and it is their median."""
    fastest = sorted(times_s)[: max(1, (len(times_s) + 1) // 2)]
    return statistics.median(fastest)


def _transport_worker(  # noqa: PLR0913
    rank: int,
    store: str,
    transport: str,
    device: str,
    sizes: tuple[int, ...],
    rounds: int,
    end_s: float,
    queue,  # noqa: ANN001
) -> None:
    """Rank 0 sends a message and waits for the same message back, for every size; rank 1 echoes.
    Before each round rank 0 says whether there is one: the untimed ones and one timed at least, then
    more while `rounds` allows and `end_s` (time.monotonic) has not passed."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    backend = "cpu:gloo,cuda:nccl" if transport == "nccl" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=2)
    gpu = device == "cuda"
    if gpu:
        torch.cuda.set_device(0 if transport == "host" else rank)
    blob = torch.frombuffer(bytearray(pickle.dumps(bytes(METADATA_BYTES))), dtype=torch.uint8)
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    where = "cuda" if gpu else "cpu"
    messages = []
    for n_bytes in sizes:
        stream = torch.zeros(n_bytes // 4, dtype=torch.float32, device=where)
        pinned = None
        if gpu and transport == "host":  # the runtime's host path: GPU -> pinned buffer -> gloo -> GPU
            pinned = torch.zeros(n_bytes // 4, dtype=torch.float32, pin_memory=True)
        messages.append((header, blob, stream, pinned))
    one_way: list[list[float]] = [[] for _ in sizes]
    another = torch.zeros(1, dtype=torch.int64)
    for i in range(rounds + UNTIMED_TRANSPORT_ROUNDS):  # one ping-pong per size: a load change hits all
        if rank == 0:
            another[0] = int(i <= UNTIMED_TRANSPORT_ROUNDS or time.monotonic() < end_s)
            dist.send(another, 1)
        else:
            dist.recv(another, 0)
        if not another[0]:
            break
        for receiving in (False, True) if rank == 0 else (True, False):  # untimed: the small path warm
            _message(messages[0], 1 - rank, receiving)  # again after the largest message
        for message, times in zip(messages, one_way, strict=True):
            begin = time.perf_counter()
            for receiving in (False, True) if rank == 0 else (True, False):
                _message(message, 1 - rank, receiving)
            if i >= UNTIMED_TRANSPORT_ROUNDS:
                times.append((time.perf_counter() - begin) / 2)
    results = list(zip(sizes, one_way, strict=True))
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        queue.put(results)


def _message(message: tuple, peer: int, receiving: bool) -> None:
    """Send or receive one message: header, metadata, hidden states (through `pinned` when set)."""
    import torch
    import torch.distributed as dist

    header, blob, stream, pinned = message
    op = dist.recv if receiving else dist.send
    op(header, peer)
    op(blob, peer)
    if pinned is None:
        op(stream, peer)
        if stream.is_cuda:
            torch.cuda.synchronize()
    elif receiving:
        dist.recv(pinned, peer)
        stream.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()
    else:
        pinned.copy_(stream)
        dist.send(pinned, peer)


def profile_components(
    settings,
    clock,
    ends: EndsShape | None,
    checkpoint: Path | None,
    transports: tuple[str, ...],
    progress: Callable[[str], None] | None = None,
    transport_sizes: tuple[int, ...] = TRANSPORT_BYTES,
    transport_rounds: int = TRANSPORT_ROUNDS,
    *,
    phases: Phases | None = None,
) -> dict[str, ComponentFit]:
    """Fits of every component that applies: the embedding and head when `ends` is known, the step
    overhead on a `checkpoint`, each of `transports`. Each is timed in its phase of the budget
    (`phases` "ends", "step", "transport:<name>"; by default `settings.budget_s` shared alike): its
    timing loops stop at the phase's deadline, with one timed round of the sizes a fit needs at least."""
    if phases is None:
        names = [*(["ends"] if ends is not None else []), *(["step"] if checkpoint is not None else [])]
        phases = Deadline.after(settings.budget_s).phases(
            {name: 1.0 for name in [*names, *(transport_key(t) for t in transports)]}
        )

    def start(name: str, what: str) -> Deadline:
        if progress:
            progress(what)
        return phases.start(name)

    fits: dict[str, ComponentFit] = {}
    if ends is not None:
        sizes, times = measure_ends(ends, settings, clock, start("ends", "embedding, LM head + sampling"))
        fits["embed"] = fit_component(sizes["embed"], times["embed"], "tokens", ends.as_dict(), table=True)
        fits["head"] = fit_component(
            sizes["head"],
            times["head"],
            "rows",
            ends.as_dict(),
            table=True,
            anchors=row_anchors(sizes["head"]),
        )
    if checkpoint is not None:
        sizes, times = measure_step_overhead(checkpoint, settings, start("step", "engine step overhead"))
        fits["step"] = fit_component(sizes, times, "sequences")
    for transport in transports:
        key = transport_key(transport)
        deadline = start(key, f"{transport} transport between two processes")
        sizes, times, _ = measure_transport(transport, settings, transport_sizes, transport_rounds, deadline)
        fits[key] = fit_component(sizes, times, "bytes", table=True)
    return fits
