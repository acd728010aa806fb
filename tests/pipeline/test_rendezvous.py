"""The pipeline's rendezvous port is held from the moment its number is chosen until stage 0's store
listens on it: no outgoing connection or other listener can take it while the stages load."""

from __future__ import annotations

import errno
import socket
import threading

import pytest

from pipeline_plans import write_plan
from tessel.pipeline.comm.group import rendezvous_address, rendezvous_store
from tessel.pipeline.executor import ProcessExecutor
from tessel.pipeline.options import RunOptions
from tessel.ports import port_of, reserve_port


def test_stage_0_serves_the_store_on_the_port_it_held() -> None:
    listener = reserve_port()
    port = port_of(listener)
    with socket.socket() as other, pytest.raises(OSError) as taken:
        other.bind(("127.0.0.1", port))
    assert taken.value.errno == errno.EADDRINUSE
    init = f"tcp://127.0.0.1:{port}"
    clients = []
    joined = threading.Thread(target=lambda: clients.append(rendezvous_store(init, 1, 2)), daemon=True)
    joined.start()  # stage 1 connects (retrying) before and while stage 0 starts its store
    master = rendezvous_store(init, 0, 2, listener.detach())
    joined.join(30)
    assert clients, "stage 1 did not reach the store"
    clients[0].set("from stage 1", "hello")
    assert master.get("from stage 1") == b"hello"


def test_the_address_comes_from_the_init_method_or_the_environment(monkeypatch) -> None:
    assert rendezvous_address("tcp://10.0.0.2:29500") == ("10.0.0.2", 29500)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29501")
    assert rendezvous_address(None) == ("127.0.0.1", 29501)
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        rendezvous_address("file:///tmp/store")


def test_an_executor_holds_its_rendezvous_port_until_it_joins(tiny_dirs, tmp_path) -> None:
    """Spawned for a one-stage plan (no children): the port is bound from spawn, freed at shutdown."""
    plan = write_plan(tmp_path / "plan.json", tiny_dirs["tied"], [(0, 5)])
    executor = ProcessExecutor.spawn(RunOptions(plan, tiny_dirs["tied"]), tmp_path)
    port = int(executor.init_method.rsplit(":", 1)[1])
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))
    executor.shutdown()
    with socket.socket() as other:
        other.bind(("127.0.0.1", port))  # given back


def test_under_torchruns_agent_every_stage_is_a_client(monkeypatch) -> None:
    """torchrun's elastic agent already serves the store at MASTER_PORT: stage 0 must not serve it."""
    from datetime import timedelta

    import torch.distributed as dist

    with reserve_port() as held:
        port = port_of(held)
    agent = dist.TCPStore("127.0.0.1", port, 3, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    init = f"tcp://127.0.0.1:{port}"
    stage0, stage1 = rendezvous_store(init, 0, 2), rendezvous_store(init, 1, 2)
    stage0.set("key", "from stage 0")
    assert stage1.get("key") == b"from stage 0"
    assert agent.num_keys() >= 1
