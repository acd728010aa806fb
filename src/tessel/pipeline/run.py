"""Run a plan: check it, spawn one worker per stage, collect outputs and statuses.

`run_pipeline(RunOptions(...))` is what `tessel launch` and the benchmark call. The plan is
checked against the model in this process first, so a bad plan is refused before any worker
starts. On this machine every stage is a worker process; with `executor="ray"` (`run_on_ray`) the
requests run in this process, stage 0, and the other stages on the machines the plan names.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from tessel.errors import TesselError
from tessel.pipeline.checks import check_options
from tessel.pipeline.options import RunOptions
from tessel.pipeline.supervision.heartbeat import RUN_DIR_ENV
from tessel.pipeline.supervision.launcher import launch, read_status


@dataclass(slots=True)
class PipelineRun:
    requests: list[dict]  # per request: token_ids, text, finish_reason, ttft_s, tpot_s, ...
    stages: list[dict]  # per stage: layers, weight_bytes, rss_bytes, batches, compute_s, ...
    wall_s: float  # stage 0's generate, from the first request added to the last token
    run_dir: Path


def describe_links(options: RunOptions) -> list[str]:
    """Where each stage runs and how the stream crosses each link, one line each (printed at start)."""
    from tessel.pipeline.devices import link_lines, link_transports, stage_device
    from tessel.pipeline.flow import describe, is_flow
    from tessel.pipeline.run_plan import load_run_plan

    plan = load_run_plan(options.plan, options.replica)
    if is_flow(plan):
        return describe(plan)
    if len(plan.stages) == 1:
        return [f"one stage on {stage_device(plan.stages[0])}"]
    return link_lines(plan, link_transports(plan, options.transport))


def run_pipeline(options: RunOptions) -> PipelineRun:
    if options.executor == "ray":  # the stages on their machines, the requests run in this process
        check_options(options, local_ranks=[0])
        return run_on_ray(options)
    num_stages = check_options(options)
    run_dir = options.run_dir or Path(tempfile.mkdtemp(prefix="tessel-run-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    outputs = run_dir / "outputs.json"
    staged = replace(options, outputs=outputs, run_dir=run_dir)
    result = launch(
        staged.write(run_dir / "run-options.json"), num_stages, run_dir, options.heartbeat_timeout
    )
    try:
        data = json.loads(outputs.read_text())
    except (OSError, ValueError) as error:
        raise TesselError(f"stage 0 finished but wrote no outputs ({error}); see {run_dir}") from None
    return PipelineRun(data["requests"], result.statuses, float(data["wall_s"]), run_dir)


def run_on_ray(options: RunOptions) -> PipelineRun:
    """`tessel launch --executor ray`: the plan's stages on their machines, the requests run here."""
    import torch

    from tessel.engine.llm_engine import LLM
    from tessel.pipeline.checks import run_requests
    from tessel.pipeline.ray_executor import RayExecutor
    from tessel.pipeline.stage.process import serve_requests, write_status

    requests = run_requests(options)
    run_dir = options.run_dir or Path(tempfile.mkdtemp(prefix="tessel-ray-run-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    previous, threads = os.environ.get(RUN_DIR_ENV), torch.get_num_threads()
    os.environ[RUN_DIR_ENV] = str(run_dir)  # stage 0 (this process) writes stage0.json there
    # as a local launch's stage 0 process does; torch's default (every core) would also spin its
    # OpenMP threads against the stages of the other machines, which share this one's cores in tests
    torch.set_num_threads(options.threads)
    try:
        executor = RayExecutor.spawn(options, run_dir)
        try:
            engine = LLM(options.model, executor=executor, **options.engine_kwargs())
            results, wall_s, later = serve_requests(options, engine, requests, executor.finish)
            write_status(0, state="done")
        except BaseException:
            executor.shutdown()
            raise
    finally:
        torch.set_num_threads(threads)
        if previous is None:
            os.environ.pop(RUN_DIR_ENV, None)
        else:
            os.environ[RUN_DIR_ENV] = previous
    return PipelineRun(results, [read_status(run_dir, 0), *later], wall_s, run_dir)
