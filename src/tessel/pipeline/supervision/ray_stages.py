"""A plan's stages on the machines of a Ray cluster: Ray is the control plane, torch.distributed the
data plane (as vLLM runs one model over machines).

Every machine joins the cluster with `ray start ... --labels tessel.node=NAME`, NAME being its
node's name in the cluster file, so the plan's device `NAME/gpu2` (or `NAME/cpu0`) says where its
stage runs. The command (`tessel serve --plan P --executor ray`, `tessel launch --executor ray`)
runs where it is typed: the HTTP server, the engine's scheduler and stage 0's layers; so it must run
on stage 0's node. Each other stage is a Ray actor (`StageAgent`) placed on its node
(`NodeAffinitySchedulingStrategy`, hard), which starts the same stage process as `tessel launch`
does on one machine (`python -m tessel.pipeline.stage.worker --options FILE`, the options written
on that node), with the process group's rendezvous at the command's node (`MASTER_ADDR`, a port
handed out here) and gloo bound to the interface of the node's own address
(`GLOO_SOCKET_IFNAME`; in a network namespace the host name resolves to loopback).

Liveness: the agent reports its stage's exit code, status and heartbeat (`poll`), which this side
feeds to the same watchdog as for local stages (`RayStages.failure`); a machine that dies, or whose
raylet is killed, is reported by Ray as the actor's death (`ActorDiedError`: final; the first
`ActorUnavailableError` is transient), and one cut off answers no poll: its silence is the
heartbeat timeout's. Either way the failure names the stage and its node, and the supervisor
rebuilds the pipeline on the nodes left. Stopping kills the actors (their stage processes die with
them, `PR_SET_PDEATHSIG`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessel.errors import TesselError
from tessel.pipeline.supervision.heartbeat import (
    Beat,
    StageProgress,
    Watchdog,
    heartbeat_timeout_s,
    process_stopped,
)
from tessel.pipeline.supervision.launcher import (
    POLL_S,
    SETTLE_S,
    FirstFailure,
    StageFailedError,
    die_with_parent,
    terminate,
    worker_env,
)

RAY_VERSION = "2.60.0"  # the pinned control plane (`pip install "tessel[cluster]"`)
NODE_LABEL = "tessel.node"  # `ray start --labels tessel.node=NAME`: NAME is the cluster file's node
CONNECT_TIMEOUT_S = 30.0  # a wrong or unreachable --ray-address is an error within this, never a hang
POLL_TIMEOUT_S = 5.0  # an agent that answers no poll this long counts as silent for that poll
INSTALL = f'pip install "tessel[cluster]" (ray=={RAY_VERSION})'
NODE_IP_ENV = "TESSEL_RAY_NODE_IP"  # the machine a process Ray started joins as (several raylets on one host)
SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise TesselError(f"--executor ray needs Ray, which is not installed: {INSTALL}") from None
    return ray


@dataclass(frozen=True, slots=True)
class RayNode:
    """A machine of the Ray cluster as the plan names it."""

    name: str  # its tessel.node label
    node_id: str
    address: str
    gpus: float


def interface_of(address: str) -> str | None:
    """The network interface holding IPv4 `address` on this machine (Linux), or None."""
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                packed = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:
                continue
            if socket.inet_ntoa(packed[20:24]) == address:
                return name
    return None


def free_port_on(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def connect(address: str | None) -> dict[str, RayNode]:
    """Join the running Ray cluster (`address`: HOST:PORT of its head; None: the one this machine is
    part of) -> its live machines by their tessel.node label. Refused within CONNECT_TIMEOUT_S when
    it cannot be reached, and when a machine has no label or two share one."""
    ray = import_ray()
    if not ray.is_initialized():
        _init_within(ray, address)
    nodes: dict[str, RayNode] = {}
    unlabelled = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        name = (node.get("Labels") or {}).get(NODE_LABEL)
        if not name:
            unlabelled.append(node.get("NodeManagerAddress", "?"))
            continue
        if name in nodes:
            raise TesselError(
                f"two Ray machines are labelled {NODE_LABEL}={name} ({nodes[name].address} and "
                f"{node.get('NodeManagerAddress')}); give each machine its own name"
            )
        gpus = float((node.get("Resources") or {}).get("GPU", 0.0))
        nodes[name] = RayNode(name, node["NodeID"], node["NodeManagerAddress"], gpus)
    if unlabelled:
        raise TesselError(
            f"Ray machines {', '.join(unlabelled)} have no {NODE_LABEL} label; start each with "
            f"`ray start ... --labels {NODE_LABEL}=NAME`, NAME its node in the cluster file"
        )
    return nodes


def _init_within(ray: Any, address: str | None) -> None:
    outcome: dict[str, BaseException | None] = {}

    def init() -> None:
        try:
            target = address or os.environ.get("RAY_ADDRESS") or "auto"
            # a server a `ServerAgent` started joins as the agent's machine: where several raylets
            # share a host (emulated machines), Ray would otherwise attach it to the head's
            node = {"_node_ip_address": os.environ[NODE_IP_ENV]} if NODE_IP_ENV in os.environ else {}
            ray.init(address=target, logging_level="ERROR", log_to_driver=False, **node)
            outcome["error"] = None
        except BaseException as error:  # noqa: BLE001 - handed to the caller below
            outcome["error"] = error

    thread = threading.Thread(target=init, name="tessel-ray-connect", daemon=True)
    thread.start()
    thread.join(CONNECT_TIMEOUT_S)
    where = address or "the local Ray cluster (ray start on this machine)"
    if thread.is_alive():
        raise TesselError(f"could not reach {where} within {CONNECT_TIMEOUT_S:g} s; check --ray-address")
    error = outcome.get("error")
    if error is not None:
        raise TesselError(f"could not join {where}: {type(error).__name__}: {error}") from None


def this_node(nodes: dict[str, RayNode]) -> RayNode:
    """The machine this process runs on, as the cluster names it."""
    ray = import_ray()
    node_id = ray.get_runtime_context().get_node_id()
    for node in nodes.values():
        if node.node_id == node_id:
            return node
    raise TesselError(
        f"this machine is not a labelled node of the Ray cluster; start it with --labels {NODE_LABEL}=NAME"
    )


def with_command_threads(env: dict[str, str], omp_threads: str | None) -> dict[str, str]:
    """`env` with the command's OMP_NUM_THREADS: Ray sets it to 1 in an actor that asked for no CPU,
    and a process the actor starts would inherit that (one torch thread where the command has many).
    (Ray 2.60 leaves CUDA_VISIBLE_DEVICES alone in an actor with no GPU: a stage sees its machine's.)"""
    env = dict(env)
    if omp_threads is None:
        env.pop("OMP_NUM_THREADS", None)
    else:
        env["OMP_NUM_THREADS"] = omp_threads
    return env


def machine_of(device: str) -> str:
    return device.split("/", 1)[0] if "/" in device else device


def check_placement(plan: Any, nodes: dict[str, RayNode], here: RayNode) -> None:
    """Refuse a plan the cluster cannot run, before any actor starts: stage 0 is this machine's
    (the command runs it), every other stage's node must be in the cluster, with the GPU it names."""
    from tessel.plan.files.plan_parts import gpu_index

    first = machine_of(plan.stages[0].device)
    if first != here.name:
        raise TesselError(
            f"stage 0 runs where the command runs, on {here.name}, but the plan puts it on {first}; "
            f"run the command on {first}"
        )
    present = ", ".join(sorted(nodes))
    for stage in plan.stages:
        name = machine_of(stage.device)
        if name not in nodes:
            raise TesselError(
                f"the plan puts stage {stage.index} on node {name!r}, which the Ray cluster lacks; its "
                f"nodes: {present} (start that machine with `ray start --address HEAD:PORT --labels "
                f"{NODE_LABEL}={name}`)"
            )
        index = gpu_index(stage.device) if stage.is_cuda else None
        if index is not None and nodes[name].gpus < index + 1:
            raise TesselError(
                f"stage {stage.index} runs on {stage.device} ({stage.gpu_type}), but Ray reports "
                f"{nodes[name].gpus:g} GPUs on node {name}"
            )


class StageAgent:
    """On a stage's machine (a Ray actor): its stage process, and what the command asks of it."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        master: tuple[str, int],
        options: str,
        timeout_s: float,
        omp_threads: str | None,
    ):
        from ray.util import get_node_ip_address

        self.rank = rank
        self.run_dir = Path(tempfile.mkdtemp(prefix=f"tessel-stage{rank}-"))
        options_file = self.run_dir / "run-options.json"
        options_file.write_text(options)
        env = worker_env(rank, world_size, master[1], self.run_dir, timeout_s, master_addr=master[0])
        env = with_command_threads(env, omp_threads)
        interface = interface_of(get_node_ip_address())
        if interface is not None:
            env["GLOO_SOCKET_IFNAME"] = interface
        log = open(self.run_dir / f"stage{rank}.log", "wb")  # noqa: SIM115 - the child owns it
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tessel.pipeline.stage.worker", "--options", str(options_file)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent,  # noqa: PLW1509
            )
        finally:
            log.close()

    def versions(self) -> dict[str, str]:
        import ray

        import tessel

        return {"ray": ray.__version__, "tessel": tessel.__version__, "python": sys.version.split()[0]}

    def poll(self) -> dict:
        """The stage's exit code (None: running), its status, heartbeat and log tail."""
        from tessel.pipeline.supervision.launcher import read_status

        code = self.proc.poll()
        beat = None
        with contextlib.suppress(OSError, ValueError):
            beat = json.loads((self.run_dir / f"stage{self.rank}.beat").read_text())
        tail = ""
        if code is not None:
            with contextlib.suppress(OSError):
                lines = (self.run_dir / f"stage{self.rank}.log").read_text(errors="replace").splitlines()
                tail = " | ".join(lines[-3:])
        return {
            "returncode": code,
            "status": read_status(self.run_dir, self.rank),
            "beat": beat,
            "log_tail": tail,
            "stopped": code is None and process_stopped(self.proc.pid),
            "pid": self.proc.pid,
        }

    def stop(self) -> None:
        terminate([self.proc])


@dataclass(slots=True)
class _Seen:
    """What this side last knew of one remote stage."""

    poll: dict | None = None
    polled_s: float = 0.0  # when it last answered
    dead: str | None = None  # Ray's word that its actor (its machine) is gone


class RayStages(FirstFailure):
    """Stages 1..S-1 of `plan` as Ray actors on the nodes the plan names: what `LocalStages` is for
    stages on this machine (`failure`, `wait_loaded`, `stop`, `stage0_progress`)."""

    def __init__(
        self,
        options_json: str,
        plan: Any,
        nodes: dict[str, RayNode],
        master: tuple[str, int],
        run_dir: Path,
        heartbeat_timeout: float | None = None,
    ) -> None:
        ray = import_ray()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.timeout_s = heartbeat_timeout_s(heartbeat_timeout)
        self.plan, self.nodes = plan, nodes
        self.node_names = [machine_of(stage.device) for stage in plan.stages]
        self.stage0_progress: StageProgress | None = None
        agent = ray.remote(StageAgent)
        omp_threads = os.environ.get("OMP_NUM_THREADS")
        self.actors = []
        for rank in range(1, len(plan.stages)):
            node = nodes[self.node_names[rank]]
            where = NodeAffinitySchedulingStrategy(node.node_id, soft=False)
            self.actors.append(
                agent.options(num_cpus=0, scheduling_strategy=where, max_restarts=0).remote(
                    rank, len(plan.stages), master, options_json, self.timeout_s, omp_threads
                )
            )
        self._seen = {rank: _Seen() for rank in self.ranks}
        self.watchdog = Watchdog(
            run_dir, list(self.ranks), self.timeout_s, time.time(), lambda: self.stage0_progress, self._beat
        )
        super().__init__()

    @property
    def ranks(self) -> range:
        return range(1, len(self.actors) + 1)

    @property
    def explain_settle_s(self) -> float:
        """How long a lost peer waits for its cause: Ray's word on a dead machine, or the silence of a
        machine cut off, which takes the heartbeat timeout to show."""
        return self.timeout_s + 2 * POLL_TIMEOUT_S

    def check_versions(self) -> None:
        """Refuse a machine whose Ray or tessel differs from this one's, naming both."""
        import ray

        import tessel

        mine = {"ray": ray.__version__, "tessel": tessel.__version__}
        for rank, theirs in zip(self.ranks, ray.get([a.versions.remote() for a in self.actors]), strict=True):
            for what in ("ray", "tessel"):
                if theirs[what] != mine[what]:
                    raise TesselError(
                        f"node {self.node_names[rank]} runs {what} {theirs[what]}, this machine "
                        f"{mine[what]}; install the same {what} on every machine"
                    )

    # ---- what the supervisor asks ----------------------------------------------------------------
    def _find_failure(self) -> StageFailedError | None:
        self._poll_all()
        lost = self._lost()
        if lost:
            settle = time.monotonic() + SETTLE_S
            while time.monotonic() < settle and len(lost) < len(self.actors):
                time.sleep(POLL_S)
                self._poll_all()
                lost = self._lost()
            priority, cause, rank = min(lost)
            return StageFailedError(rank, cause, node=self.node_names[rank])
        running = lambda rank: self._seen[rank].poll is not None  # noqa: E731 - polled once at least
        silent = self.watchdog.check(running)
        if silent is not None:
            rank, cause = silent
            return StageFailedError(rank, cause, node=self.node_names[rank])
        return None

    def _lost(self) -> list[tuple[int, str, int]]:
        """(priority, cause, rank) of every stage gone: its machine (Ray's word) or its process."""
        from tessel.pipeline.supervision.launcher import failure_cause_of

        found = []
        for rank, seen in self._seen.items():
            where = f"on node {self.node_names[rank]}"
            if seen.dead is not None:
                found.append((0, f"its node {self.node_names[rank]} is lost ({seen.dead})", rank))
            elif seen.poll is not None and seen.poll["returncode"] is not None:
                poll = seen.poll
                priority, cause = failure_cause_of(poll["returncode"], poll["status"], poll["log_tail"])
                found.append((priority, f"{cause} ({where})", rank))
        return found

    def _poll_all(self) -> None:
        ray = import_ray()
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        live = [rank for rank in self.ranks if not self._seen[rank].dead]
        pending = {self.actors[rank - 1].poll.remote(): rank for rank in live}
        if not pending:
            return
        ready, _ = ray.wait(list(pending), num_returns=len(pending), timeout=POLL_TIMEOUT_S)
        now = time.time()
        for ref in ready:
            rank = pending[ref]
            try:
                self._seen[rank].poll, self._seen[rank].polled_s = ray.get(ref), now
            except ActorUnavailableError:
                continue  # transient (Ray's word): silence until it answers or dies
            except (ActorDiedError, RayActorError) as error:
                self._seen[rank].dead = type(error).__name__

    def _beat(self, run_dir: Path, rank: int) -> Beat | None:
        """A stage's last heartbeat as its agent reported it; silence since the last answer ages it."""
        seen = self._seen[rank]
        beat = None if seen.poll is None else seen.poll.get("beat")
        if beat is None:
            return None
        try:
            return Beat(float(beat["time_s"]), StageProgress(**beat["progress"]))
        except (KeyError, TypeError, ValueError):
            return None

    def wait_loaded(self, timeout_s: float | None = None) -> None:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            failure = self.failure()
            if failure is not None:
                raise failure
            states = [(self._seen[r].poll or {}).get("status", {}).get("state") for r in self.ranks]
            if all(state in ("loaded", "ready") for state in states):
                return
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"the new stages did not load their layers within {timeout_s:g} s")
            time.sleep(POLL_S)

    def statuses(self) -> list[dict]:
        """Each remote stage's last status (`stage<k>.json` on its machine)."""
        self._poll_all()
        return [(self._seen[r].poll or {}).get("status", {"stage": r}) for r in self.ranks]

    def alive(self, rank: int) -> bool:
        seen = self._seen[rank]
        return seen.dead is None and (seen.poll is None or seen.poll["returncode"] is None)

    def beat_age_s(self, rank: int, now: float) -> float | None:
        beat = self._beat(self.run_dir, rank)
        return None if beat is None else max(now - beat.time_s, 0.0)

    def stop(self) -> None:
        """Kill every stage's actor (its stage process dies with it); their ends are not failures."""
        ray = import_ray()
        with self._lock:
            self._stopped = True
            for actor in self.actors:
                with contextlib.suppress(Exception):
                    ray.kill(actor, no_restart=True)


def stage_env_for_driver(address: str) -> None:
    """This process's gloo bound to the interface of its node address (stage 0 of a Ray pipeline)."""
    interface = interface_of(address)
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface
