"""A stage's loop after joining: micro-batches from its predecessors until every one says stop.

Each micro-batch runs on this stage's block ids (`FlowBlocks.local_meta`: the pool's own on one path,
the stage's share of each path's range on several), after the KV copies stage 0 made before it are
repeated on this stage's layers (`StageRunner.adopt`). The stage that ends the micro-batch's path
samples it and sends the tokens to stage 0; any other sends the residual stream to the path's next
stage. A path's first stage that is not rank 0 embeds the token ids rank 0 sent it.
"""

from __future__ import annotations

import time
from dataclasses import replace

from tessel.pipeline.comm.links import StageComm
from tessel.pipeline.flow import FlowBlocks
from tessel.pipeline.stage.runner import StageRunner, StageStats


def serve_stage(comm: StageComm, runner: StageRunner, blocks: FlowBlocks) -> None:
    """Run micro-batches until every predecessor said stop, then pass the stop on."""
    runner.progress = comm.progress  # the heartbeat carries its batches and busy seconds
    serving_cpu = time.process_time()
    while True:
        waited, waited_cpu = time.perf_counter(), time.thread_time()
        received = comm.recv_batch()
        if received is None:
            break
        message, stream, ids = received
        if message.fresh_stats:  # stage 0's warm-up is over: count from this batch
            runner.stats, serving_cpu = StageStats(), time.process_time()
        stats = runner.stats
        adopting = time.perf_counter()
        stats.recv_s += adopting - waited
        stats.recv_thread_cpu_s += time.thread_time() - waited_cpu
        local = replace(message, meta=blocks.local_meta(message.meta))
        runner.adopt(local)
        stats.adopt_s += time.perf_counter() - adopting
        started, cpu_started, thread_started = time.perf_counter(), time.process_time(), time.thread_time()
        out = runner.runner.run_stage(local.positions, local.meta, input_ids=ids, stream=stream)
        last = message.path[-1] == comm.rank
        sampled = runner.sample(out, message) if last else None  # tokens and the logprobs asked for
        prefill = out.shape[0] > len(message.sample_rows)
        runner.account(started, out.shape[0], cpu_started, prefill, thread_started)
        sending = time.perf_counter()
        if last:
            comm.send_tokens(message.batch_id, sampled)
        else:
            comm.send_batch(message, out)
        runner.stats.send_s += time.perf_counter() - sending
    comm.send_stop()
    comm.flush()
    runner.stats.process_cpu_s = time.process_time() - serving_cpu
