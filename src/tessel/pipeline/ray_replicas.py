"""A plan of several replicas across machines: each replica's server (`tessel serve --replica K
--executor ray`) runs on the machine of the replica's first stage, and places the replica's other
stages itself (`tessel.pipeline.ray_executor`); the router runs where the command runs and forwards
to each server's address (`tessel.server.replica_router`, as for servers on this machine).

A `ServerAgent` actor, pinned to that machine, starts the server process there on a free port of
the machine's address and answers for it: its exit, its log's last lines, signals. `RemoteServer`
is what the router holds for it (the shape of a `subprocess.Popen`): a machine that dies is Ray's
word on the agent (`ActorDiedError`), which reads as the server killed, naming the machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tessel.errors import TesselError
from tessel.pipeline.run_plan import load_run_plan
from tessel.pipeline.supervision.launcher import POLL_S, die_with_parent
from tessel.pipeline.supervision.ray_stages import (
    NODE_IP_ENV,
    NODE_LABEL,
    POLL_TIMEOUT_S,
    RayNode,
    connect,
    import_ray,
    machine_of,
    with_command_threads,
)
from tessel.ports import port_of, reserve_port
from tessel.server.replica_backends import Backend, ReplicaSpec, SpawnBackend, backend_argv, listen_argv


class ServerAgent:
    """On a replica's first machine (a Ray actor): that replica's server process."""

    def __init__(self, argv: list[str], replica: int, omp_threads: str | None) -> None:
        from ray.util import get_node_ip_address

        self.address = get_node_ip_address()
        self.log_path = Path(tempfile.mkdtemp(prefix=f"tessel-replica{replica}-")) / f"replica{replica}.log"
        with reserve_port(self.address) as listener, open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [*argv, *listen_argv(listener)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(listener.fileno(),),
                env=with_command_threads({**os.environ, NODE_IP_ENV: self.address}, omp_threads),
                preexec_fn=die_with_parent,  # noqa: PLW1509
            )
            self.port = port_of(listener)

    def where(self) -> tuple[str, int, int, str]:
        """(address, port, pid, log path) of the server."""
        return self.address, self.port, self.proc.pid, str(self.log_path)

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self, number: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(number)

    def log_tail(self, lines: int) -> str:
        from tessel.server.replica_backends import log_tail

        return log_tail(self.log_path, lines)


class RemoteServer:
    """A replica's server on another machine, as the router drives a child process."""

    def __init__(self, actor: Any, node: str, pid: int) -> None:
        self.actor, self.node, self.pid = actor, node, pid
        self._code: int | None = None
        self._lost: str | None = None

    def poll(self) -> int | None:
        if self._code is not None:
            return self._code
        ray = import_ray()
        from ray.exceptions import ActorDiedError, ActorUnavailableError, GetTimeoutError, RayActorError

        try:
            self._code = ray.get(self.actor.poll.remote(), timeout=POLL_TIMEOUT_S)
        except (GetTimeoutError, ActorUnavailableError):
            return None  # no word yet: the router's /health probes judge its silence
        except (ActorDiedError, RayActorError) as error:
            self._lost = f"its machine {self.node} is lost ({type(error).__name__})"
            self._code = -signal.SIGKILL
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"replica server on {self.node}", timeout or 0.0)
            time.sleep(POLL_S)
        return self._code if self._code is not None else 0

    def send_signal(self, number: int) -> None:
        if self._code is None:
            with contextlib.suppress(Exception):
                self.actor.signal.remote(int(number))

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """The agent and its server go (the server dies with its agent, `PR_SET_PDEATHSIG`)."""
        with contextlib.suppress(Exception):
            import_ray().kill(self.actor, no_restart=True)
        if self._code is None:
            self._code = -signal.SIGKILL

    def log_tail(self) -> str:
        if self._lost is not None:
            return self._lost
        with contextlib.suppress(Exception):
            return import_ray().get(self.actor.log_tail.remote(3), timeout=POLL_TIMEOUT_S)
        return f"no log from machine {self.node}"


def replica_nodes(plan: Path, specs: list[ReplicaSpec], nodes: dict[str, RayNode]) -> dict[int, RayNode]:
    """Each replica's first machine; refused naming the replica when the cluster lacks it."""
    placed = {}
    for spec in specs:
        name = machine_of(load_run_plan(plan, spec.index).stages[0].device)
        if name not in nodes:
            raise TesselError(
                f"replica {spec.index} starts on node {name!r}, which the Ray cluster lacks; its nodes: "
                f"{', '.join(sorted(nodes))} (start that machine with `ray start --address HEAD:PORT "
                f"--labels {NODE_LABEL}={name}`)"
            )
        placed[spec.index] = nodes[name]
    return placed


def ray_backends(
    model: Path, plan: Path, specs: list[ReplicaSpec], options: list[str], ray_address: str | None
) -> SpawnBackend:
    """How the router starts each replica's server over Ray (checked for every replica first)."""
    ray = import_ray()
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = connect(ray_address)
    placed = replica_nodes(plan, specs, nodes)
    head = ray.get_runtime_context().gcs_address  # the servers join the cluster this one did
    agent = ray.remote(ServerAgent)
    omp_threads = os.environ.get("OMP_NUM_THREADS")

    on_ray = [*options, "--executor", "ray", "--ray-address", head]

    def spawn(spec: ReplicaSpec, run_dir: Path) -> Backend:
        node = placed[spec.index]
        argv = backend_argv(model, plan, spec.index, on_ray)
        where = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
        actor = agent.options(num_cpus=0, scheduling_strategy=where, max_restarts=0).remote(
            argv, spec.index, omp_threads
        )
        address, port, pid, log = ray.get(actor.where.remote())
        server = RemoteServer(actor, node.name, pid)
        return Backend(spec, server, port, Path(log), host=address, node=node.name)

    return spawn


__all__ = ["RemoteServer", "ServerAgent", "ray_backends", "replica_nodes"]
