"""`tessel serve`: an OpenAI-compatible HTTP server for one local model.

torch, fastapi and uvicorn are imported inside the command, so the planner side of the CLI loads
without the runtime extra. Every option is checked before the model loads. When the engine fails
more often than `--max-engine-restarts` allows, the server shuts down and exits with status 3, so
a supervisor (systemd, Kubernetes) restarts it. With `--plan`, a stage that dies or sends no
heartbeat for `--heartbeat-timeout` seconds makes the server rebuild the pipeline on the stages
left (new stage processes) and move the requests in flight into it
(`tessel.pipeline.supervision.supervisor`), each
rebuild counting against `--max-engine-restarts`: meanwhile `/health` answers 503 naming the stage,
with Retry-After, and new requests wait. Past the budget, or when a rebuild fails (the stages left
cannot hold the model), the server stays up without a pipeline, answering 503 with the cause, and
never exits by itself.
A `--plan` of several replicas without `--replica` runs one such server per replica behind a router
that splits requests by the plan's weights (`tessel.server.replica_router`); a flow plan (paths
sharing GPUs) runs as one process per placement with requests split over its paths by the flow
weights (`tessel.pipeline.flow`). With `--plan`, `/metrics` shows each stage's measured step
time beside the plan's (`tessel.pipeline.supervision.remap_watch`); with `--remap auto` the server
re-plans when they drift and moves to the new split live.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from tessel.commands.embed import MATRYOSHKA_OPTION, EncoderServeOptions, is_encoder_dir, serve_encoder
from tessel.commands.options import (
    ASYNC_SCHEDULING_OPTION,
    DEVICE_OPTION,
    ENFORCE_EAGER_OPTION,
    EXECUTOR_OPTION,
    HOST_KV_OPTIONS,
    LM_HEAD_OPTION,
    MAX_MODEL_LEN_OPTION,
    MAX_NUM_SEQS_OPTION,
    RAY_ADDRESS_OPTION,
    TENSOR_PARALLEL_OPTION,
    ExecutorKind,
    LMHeadMode,
    check_model_path,
    float_option,
    heartbeat_timeout_option,
    kv_cache_gib_option,
    runtime_dtype_option,
    with_option_groups,
)
from tessel.commands.remap_options import REMAP_OPTIONS, RemapFlags
from tessel.errors import TesselError
from tessel.server.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_ENGINE_RESTARTS,
    DEFAULT_MAX_PROMPT_CHARS,
    MAX_BODY_TIMEOUT_S,
    MIN_BODY_TIMEOUT_S,
)
from tessel.server.listen import inherited_socket, listen_address, run_server

DEFAULT_MAX_QUEUE = 128  # requests that may wait for a free sequence slot before the server answers 429
ENGINE_DEAD_EXIT_CODE = 3
MAX_FD = 2**31 - 1  # a file descriptor is a C int


class LogLevel(str, Enum):
    critical = "critical"
    error = "error"
    warning = "warning"
    info = "info"
    debug = "debug"
    trace = "trace"


def _options_argv(**options: object) -> list[str]:
    """`--name value` for each option given (None: left out), as `tessel serve` spells them."""
    argv: list[str] = []
    for name, value in options.items():
        if value is not None:
            argv += [f"--{name.replace('_', '-')}", str(value)]
    return argv


@with_option_groups
def serve(
    model: Path = typer.Option(..., "--model", help="Local Hugging Face model directory, or a .gguf file."),
    host: str = typer.Option("127.0.0.1", help="Address to bind (127.0.0.1 keeps it on this machine)."),
    port: int = typer.Option(8000, min=0, max=65535, help="TCP port to listen on."),
    listen_fd: int | None = typer.Option(
        None,
        min=0,
        max=MAX_FD,
        help="Listen on this inherited, already-bound TCP socket instead of binding --host/--port "
        "(as systemd socket activation passes one; tessel's router starts its replicas so).",
    ),
    dtype: str = runtime_dtype_option(),
    max_num_seqs: int | None = MAX_NUM_SEQS_OPTION,
    max_model_len: int | None = MAX_MODEL_LEN_OPTION,
    kv_cache_gib: float | None = kv_cache_gib_option(
        "Memory for the paged KV cache, in GiB (at most what the machine has free)."
    ),
    max_queue: int = typer.Option(
        DEFAULT_MAX_QUEUE, min=0, help="Requests that may wait beyond the running ones; more get HTTP 429."
    ),
    max_body_bytes: int = typer.Option(
        DEFAULT_MAX_BODY_BYTES, min=1, help="Largest request body; a larger one gets HTTP 413."
    ),
    body_timeout_s: float = float_option(
        DEFAULT_BODY_TIMEOUT_S,
        "--body-timeout-s",
        low=MIN_BODY_TIMEOUT_S,
        high=MAX_BODY_TIMEOUT_S,
        help="Seconds a request body may take to arrive after its headers; slower gets HTTP 408 and a close.",
    ),
    max_prompt_chars: int = typer.Option(
        DEFAULT_MAX_PROMPT_CHARS, min=1, help="Longest text prompt (all chat messages together); 400 above."
    ),
    max_prompt_tokens: int | None = typer.Option(
        None, min=1, help="Most prompt tokens (default: max-model-len minus one); 400 above."
    ),
    max_engine_restarts: int = typer.Option(
        DEFAULT_MAX_ENGINE_RESTARTS,
        min=0,
        help="Engine failures survived before the server exits (with --plan: pipeline rebuilds after a "
        "stage failure, then 503 for good).",
    ),
    served_model_name: str | None = typer.Option(
        None, help="Model id for clients (default: the directory name)."
    ),
    log_level: LogLevel = typer.Option(LogLevel.info, case_sensitive=False, help="uvicorn log level."),
    plan: Path | None = typer.Option(
        None, "--plan", help="Serve through this plan's pipeline (one process per stage, `tessel launch`)."
    ),
    replica: int | None = typer.Option(
        None,
        min=0,
        help="With --plan of several replicas: which pipeline this server runs (default: all of them, "
        "one server each, behind a router that splits requests by the plan's weights).",
    ),
    executor: ExecutorKind = EXECUTOR_OPTION,
    ray_address: str | None = RAY_ADDRESS_OPTION,
    heartbeat_timeout: float | None = heartbeat_timeout_option(
        "With --plan: seconds a stage may send no heartbeat before it counts as failed"
    ),
    remap: RemapFlags = REMAP_OPTIONS,
    lm_head: LMHeadMode = LM_HEAD_OPTION,
    enforce_eager: bool = ENFORCE_EAGER_OPTION,
    async_scheduling: bool = ASYNC_SCHEDULING_OPTION,
    tensor_parallel_size: int = TENSOR_PARALLEL_OPTION,
    device: str = DEVICE_OPTION,
    matryoshka: bool = MATRYOSHKA_OPTION,
    host_kv: dict[str, object] = HOST_KV_OPTIONS,
) -> None:
    """Serve MODEL over OpenAI's API: /v1/completions, /v1/chat/completions, /v1/models, /health;
    an encoder (BERT, sentence-transformers) serves /v1/embeddings."""
    listener = None if listen_fd is None else inherited_socket(listen_fd)
    if listener is not None:
        host, port = listen_address(listener)  # what the messages name
    if is_encoder_dir(model):
        sizes = {"max_body_bytes": max_body_bytes, "max_prompt_chars": max_prompt_chars}
        limits = sizes | {"body_timeout_s": body_timeout_s}
        name, level = served_model_name, log_level.value
        options = EncoderServeOptions(host, port, dtype, device, name, level, matryoshka)
        serve_encoder(model, options, limits, plan=plan, listener=listener)
        return
    check_model_path(model, "--model")
    if replica is not None and plan is None:
        raise TesselError("--replica picks a pipeline of a --plan; give --plan too")
    if (executor != "local" or ray_address is not None) and plan is None:
        raise TesselError("--executor and --ray-address place the stages of a --plan; give --plan too")
    if ray_address is not None and executor != "ray":
        raise TesselError("--ray-address joins a Ray cluster; give --executor ray too")
    if heartbeat_timeout is not None and plan is None:
        raise TesselError("--heartbeat-timeout watches the stages of a --plan; give --plan too")
    if plan is not None and lm_head != "float":
        raise TesselError(f"--lm-head {lm_head} cannot be combined with --plan yet; serve in one process")
    if plan is not None and device != "cpu":
        raise TesselError(
            f"--device {device} cannot be combined with --plan: each stage runs on the device its plan "
            "stage names (re-plan with `tessel plan --cluster local` for this machine's GPUs)"
        )
    if remap.mode == "auto" and plan is None:
        raise TesselError("--remap auto re-plans the pipeline of a --plan; give --plan too")

    import uvicorn

    from tessel.engine.llm_engine import LLMEngine
    from tessel.engine.memory import check_kv_cache_fits
    from tessel.server.app import create_app
    from tessel.server.async_engine import Recovery, recovery_for
    from tessel.server.limits import ServerLimits

    if kv_cache_gib is not None:
        check_kv_cache_fits(kv_cache_gib, device)
    limits = ServerLimits(
        max_body_bytes,
        max_prompt_chars,
        max_prompt_tokens,
        max_engine_restarts=max_engine_restarts,
        body_timeout_s=body_timeout_s,
    )
    options = {"max_num_seqs": max_num_seqs, "max_model_len": max_model_len, "kv_cache_gib": kv_cache_gib}
    options |= {"host_kv_cache_gib": None, "emulate_host_gbps": None} | host_kv
    kwargs = {k: v for k, v in options.items() if v is not None}
    if plan is not None and replica is None:
        from tessel.pipeline.flow import is_flow
        from tessel.pipeline.run_plan import load_run_plan
        from tessel.pipeline.supervision.heartbeat import heartbeat_timeout_s
        from tessel.server.replica_router import RouterOptions, replica_specs, serve_replicas

        specs = replica_specs(plan)
        if remap.mode == "auto" and is_flow(load_run_plan(plan)):
            raise TesselError("--remap auto re-plans one pipeline; a flow plan is served as planned")
        if len(specs) > 1 and remap.mode == "auto":
            raise TesselError("--remap auto remaps one pipeline; serve one replica (--replica K)")
        if len(specs) > 1:  # one server per replica, and a router in front of them
            timeout_s = heartbeat_timeout_s(heartbeat_timeout)
            backend_options = _options_argv(
                dtype=dtype, **options, max_queue=max_queue, max_body_bytes=max_body_bytes,
                body_timeout_s=body_timeout_s, max_prompt_chars=max_prompt_chars,
                max_prompt_tokens=max_prompt_tokens, max_engine_restarts=max_engine_restarts,
                served_model_name=served_model_name, log_level=log_level.value, heartbeat_timeout=timeout_s,
            ) + (["--async-scheduling"] if async_scheduling else [])  # fmt: skip
            level = log_level.value
            router = RouterOptions(
                model, plan, host, port, backend_options, timeout_s, limits, level,
                executor=executor, ray_address=ray_address, listener=listener,
            )  # fmt: skip
            serve_replicas(router, specs, echo=lambda line: typer.echo(line, err=True))
            return
    if plan is not None and tensor_parallel_size > 1:
        raise TesselError(
            "--tensor-parallel-size splits one engine; with --plan, the plan's stages say their tp_degree"
        )
    if plan is None:
        engine = LLMEngine(
            str(model),
            dtype=dtype,
            lm_head=lm_head,
            enforce_eager=enforce_eager,
            async_scheduling=async_scheduling,
            device=device,
            tensor_parallel_size=tensor_parallel_size,
            **kwargs,
        )
        engine.warm_up()  # the compiled decode step, before the first request would wait for it
    else:
        from tessel.pipeline.options import RunOptions
        from tessel.pipeline.supervision.heartbeat import heartbeat_timeout_s
        from tessel.pipeline.supervision.supervisor import Supervisor

        timeout_s = heartbeat_timeout_s(heartbeat_timeout)
        placed = {"executor": executor, "ray_address": ray_address}
        run = RunOptions(
            plan, model, dtype=dtype, replica=replica, heartbeat_timeout=timeout_s,
            async_scheduling=async_scheduling, **placed, **kwargs,
        )  # fmt: skip
        engine = Supervisor.serve(run, max_engine_restarts)  # rebuilds count against the restarts
    app = create_app(
        engine,
        max_pending=engine.config.max_num_seqs + max_queue,
        model_name=served_model_name,
        limits=limits,
    )
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level=log_level.value))
    async_engine = app.state.async_engine
    async_engine.on_dead = lambda: setattr(server, "should_exit", True)
    if plan is not None:
        from tessel.pipeline.supervision.remap_watch import start_remap_watch
        from tessel.server.prometheus import RemapCollector

        watch = start_remap_watch(
            async_engine, remap.settings, remap.mode, lambda line: typer.echo(line, err=True)
        )
        app.state.metrics.registry.register(RemapCollector(watch))  # measured beside predicted
    typer.echo(f"tessel: serving {app.state.model_name} on http://{host}:{port}/v1", err=True)
    try:
        run_server(server, listener)
    finally:
        if plan is not None:
            engine.supervisor.close()  # the stages of the pipeline last built
    if async_engine.error is not None and recovery_for(async_engine.error) is not Recovery.RESTART:
        raise TesselError(
            f"stopped without a pipeline: {async_engine.error}", exit_code=ENGINE_DEAD_EXIT_CODE
        )
    if async_engine.error is not None:
        raise TesselError(
            f"the engine failed {async_engine.num_restarts + 1} times ({async_engine.error}); exiting so a "
            "supervisor can restart the server",
            exit_code=ENGINE_DEAD_EXIT_CODE,
        )
