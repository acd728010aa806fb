"""Machines of a Ray cluster emulated on this one: Linux network namespaces on a bridge, each with its
own address and its own `ray start` (issue 44's test cluster).

    with EmulatedHosts(["head", "h1", "h2"]) as hosts:
        hosts.run(["tessel", "launch", ...], host="head")    # a command on a host
        hosts.kill_raylet("h2")                               # a machine lost
        hosts.leave("h2"); hosts.join("h2")                   # a machine leaves, one joins
        hosts.cut("h2")                                       # its link down
        hosts.shape("h1", mbit=100)                           # its link at 100 Mbit/s (tc tbf)

Each host is a namespace `tsl<k>-<name>` with a veth pair (`tslv<k>` on the bridge `tslbr`, `eth0`
inside) at 10.213.<net>.<10 + k>/24; the bridge holds .1 and is the default route, so the test
(outside every namespace) reaches each host. `ray start --block` runs in each, under `setsid`, with
an explicit `--node-ip-address`, its own `--temp-dir`, `--num-cpus 1`, a small object store, no
dashboard, and `--labels tessel.node=NAME`; `ray start` returns before the node is registered, so
the cluster is up once `ray.nodes()` (asked from the head) lists every host alive. A host is
stopped by the PIDs of its namespace (`ip netns pids`), never `ray stop`, which finds processes by
name in every namespace. Needs root (CI runs as root) and Ray; `available()` says why not.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUBNET = "10.213.{net}"
RAY_PORT = 6379
UP_TIMEOUT_S = 90.0  # three raylets on a loaded 2-core machine
OBJECT_STORE_BYTES = 80 * 2**20
BRIDGE = "tslbr"
# a lost machine reported dead in about 3 s instead of Ray's default 14 s (GCS health checks)
FAST_HEALTH = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


def available() -> str | None:
    """Why emulated hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    try:
        import ray  # noqa: F401
    except ImportError:
        return 'Ray is not installed (pip install "tessel[cluster]")'
    return None


def _ip(*args: str, namespace: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    command = ["ip", *args] if namespace is None else ["ip", "netns", "exec", namespace, "ip", *args]
    return subprocess.run(command, capture_output=True, text=True, check=check)


class EmulatedHosts:
    def __init__(self, names: list[str], net: int = 0, root: Path | None = None) -> None:
        self.names = list(names)
        self.net = net
        self.root = root or Path(tempfile.mkdtemp(prefix="tessel-hosts-"))
        self.started_s = 0.0
        self.up_s = 0.0  # seconds from the first `ip` to every node registered

    # ---- addresses ---------------------------------------------------------------------------------
    def namespace(self, name: str) -> str:
        return f"tsl{self.names.index(name)}-{name}"[:15]

    def veth(self, name: str) -> str:
        return f"tslv{self.net}{self.names.index(name)}"

    def address(self, name: str) -> str:
        return f"{SUBNET.format(net=self.net)}.{10 + self.names.index(name)}"

    @property
    def head_address(self) -> str:
        return f"{self.address(self.names[0])}:{RAY_PORT}"

    # ---- up and down ---------------------------------------------------------------------------------
    def __enter__(self) -> EmulatedHosts:
        self.started_s = time.monotonic()
        try:
            self._network()
            for name in self.names:
                self._ray_start(name)
                if name == self.names[0]:
                    self._wait_nodes(1)
            self._wait_nodes(len(self.names))
        except BaseException:
            self.__exit__()
            raise
        self.up_s = time.monotonic() - self.started_s
        return self

    def __exit__(self, *exc: object) -> None:
        for name in self.names:
            self.stop(name)
        for name in self.names:
            _ip("netns", "del", self.namespace(name), check=False)
            _ip("link", "del", self.veth(name), check=False)
        _ip("link", "del", f"{BRIDGE}{self.net}", check=False)

    def _network(self) -> None:
        bridge = f"{BRIDGE}{self.net}"
        _ip("link", "del", bridge, check=False)  # left by a run that was killed
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{SUBNET.format(net=self.net)}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for name in self.names:
            ns, veth = self.namespace(name), self.veth(name)
            _ip("netns", "del", ns, check=False)
            _ip("link", "del", veth, check=False)  # left by a run that was killed
            _ip("netns", "add", ns)
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", bridge, "up")
            _ip("addr", "add", f"{self.address(name)}/24", "dev", "eth0", namespace=ns)
            _ip("link", "set", "eth0", "up", namespace=ns)
            _ip("link", "set", "lo", "up", namespace=ns)
            _ip("route", "add", "default", "via", f"{SUBNET.format(net=self.net)}.1", namespace=ns)

    def _ray_start(self, name: str) -> None:
        ray = str(Path(sys.executable).with_name("ray"))
        head = name == self.names[0]
        command = [ray, "start", "--block", "--node-ip-address", self.address(name), "--num-cpus", "1"]
        command += ["--object-store-memory", str(OBJECT_STORE_BYTES), "--labels", f"tessel.node={name}"]
        command += ["--temp-dir", str(self.root / f"ray-{name}")]
        command += ["--head", "--port", str(RAY_PORT), "--include-dashboard=false"] if head else [
            "--address", self.head_address
        ]  # fmt: skip
        log = open(self.root / f"ray-{name}.log", "wb")  # noqa: SIM115 - the child owns it
        subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(name), *command],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **FAST_HEALTH},
        )  # fmt: skip
        log.close()

    def alive_nodes(self) -> list[str]:
        """The tessel.node labels of the nodes Ray reports alive (asked from the head's namespace)."""
        code = (
            f"import json, ray; ray.init(address={self.head_address!r}, logging_level='ERROR', "
            "log_to_driver=False);"
            "print(json.dumps([n['Labels'].get('tessel.node') for n in ray.nodes() if n['Alive']]))"
        )
        done = self.run([sys.executable, "-c", code], host=self.names[0], timeout=60, check=False)
        try:
            return json.loads(done.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return []

    def _wait_nodes(self, count: int) -> None:
        deadline = time.monotonic() + UP_TIMEOUT_S
        while len(alive := self.alive_nodes()) < count:
            if time.monotonic() > deadline:
                logs = {
                    n: (self.root / f"ray-{n}.log").read_text(errors="replace")[-800:] for n in self.names
                }
                raise RuntimeError(f"only {alive} of {self.names} came up; logs: {logs}")
            time.sleep(1.0)

    def _log_tail(self, name: str) -> str:
        return (self.root / f"ray-{name}.log").read_text(errors="replace")[-800:]

    # ---- what tests do to hosts -------------------------------------------------------------------
    def env(self, host: str) -> dict[str, str]:
        env = dict(os.environ)
        env["RAY_ADDRESS"] = self.head_address
        return env

    def run(
        self, command: list[str], host: str, timeout: float = 600, check: bool = True
    ) -> subprocess.CompletedProcess:
        """`command` in `host`'s namespace, to its end."""
        done = subprocess.run(
            ["ip", "netns", "exec", self.namespace(host), *command],
            capture_output=True, text=True, timeout=timeout, env=self.env(host),
        )  # fmt: skip
        if check and done.returncode != 0:
            raise AssertionError(f"{command} on {host} exited {done.returncode}:\n{done.stderr[-4000:]}")
        return done

    def popen(self, command: list[str], host: str, **kwargs) -> subprocess.Popen:  # noqa: ANN003
        """`command` started in `host`'s namespace (its own session: stop it by its group)."""
        return subprocess.Popen(
            ["ip", "netns", "exec", self.namespace(host), *command],
            env=self.env(host), start_new_session=True, **kwargs,
        )  # fmt: skip

    @contextlib.contextmanager
    def serving(self, command: list[str], port: int, log: Path, timeout_s: float = 180.0):
        """`command` (a `tessel serve ...`) over Ray on the head, listening on `port` of every
        address, its stderr in `log`; -> an httpx client of it once it answers /health 200 (an error
        naming the log's tail if it exits first); stopped (SIGTERM, then SIGKILL) after."""
        import httpx

        argv = [
            *command,
            "--executor",
            "ray",
            "--host",
            "0.0.0.0",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ]
        with open(log, "wb") as stderr:
            server = self.popen(argv, host=self.names[0], stderr=stderr)
        try:
            url = f"http://{self.address(self.names[0])}:{port}"
            with httpx.Client(base_url=url, timeout=timeout_s) as client:
                deadline = time.monotonic() + timeout_s
                while True:
                    if server.poll() is not None:
                        raise RuntimeError(f"the server exited: {log.read_text()[-3000:]}")
                    with contextlib.suppress(httpx.TransportError):
                        if client.get("/health").status_code == 200:
                            break
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the server did not start within {timeout_s:g} s")
                    time.sleep(0.5)
                yield client
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()

    def pids(self, name: str) -> list[int]:
        found = _ip("netns", "pids", self.namespace(name), check=False).stdout.split()
        return [int(pid) for pid in found]

    def stop(self, name: str) -> None:
        """Every process of the host, by PID (SIGKILL)."""
        for pid in self.pids(name):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill_raylet(self, name: str) -> list[int]:
        """The machine lost: its raylet and everything else it runs, killed; -> the PIDs killed."""
        pids = self.pids(name)
        self.stop(name)
        return pids

    def restart(self, name: str) -> None:
        """A machine back (after a loss or a cut): its processes stopped, its link up, its `ray start`
        again, once Ray has every machine alive again."""
        self.leave(name)
        _ip("link", "set", self.veth(name), "up")
        self.join(name)

    def leave(self, name: str) -> None:
        """The machine out of the cluster: its processes stopped, once Ray no longer lists it alive."""
        self.stop(name)
        deadline = time.monotonic() + UP_TIMEOUT_S
        while name in self.alive_nodes():
            assert time.monotonic() < deadline, f"{name} still reported alive"
            time.sleep(1.0)

    def join(self, name: str) -> None:
        """The machine (back) in the cluster: its `ray start`, once Ray lists every machine alive."""
        self._ray_start(name)
        self._wait_nodes(len(self.names))

    def cut(self, name: str) -> None:
        """The machine cut off: its link set down (its processes live on)."""
        _ip("link", "set", self.veth(name), "down")

    def unshape(self, name: str) -> None:
        for device, namespace in ((self.veth(name), None), ("eth0", self.namespace(name))):
            command = ["tc", "qdisc", "del", "dev", device, "root"]
            full = command if namespace is None else ["ip", "netns", "exec", namespace, *command]
            subprocess.run(full, capture_output=True, text=True, check=False)

    def shape(self, name: str, mbit: int) -> None:
        """The machine's link limited to `mbit` Mbit/s each way (tc tbf on both ends)."""
        for device, namespace in ((self.veth(name), None), ("eth0", self.namespace(name))):
            _ip("link", "show", device, namespace=namespace)  # exists
            command = ["tc", "qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{mbit}mbit"]
            command += ["burst", "64kb", "latency", "50ms"]
            full = command if namespace is None else ["ip", "netns", "exec", namespace, *command]
            subprocess.run(full, capture_output=True, text=True, check=True)
