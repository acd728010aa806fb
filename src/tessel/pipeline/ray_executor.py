"""A plan's pipeline across machines: the `ProcessExecutor` whose other stages Ray places on the nodes
the plan names (`tessel.pipeline.supervision.ray_stages`).

`RayExecutor.spawn(options, run_dir)` joins the Ray cluster (`options.ray_address`), refuses a plan
the cluster cannot run before any actor starts (a node it lacks, a GPU a node does not have, stage 0
not on this machine, a machine whose Ray or tessel differs), starts the other stages as actors and
hands their rendezvous (this node's address and a free port) to them; from then on it is the
`ProcessExecutor` every engine drives: the same messages, the same stage loop, the same supervisor
(rebuild on the nodes left after a lost machine, live remap). `tessel launch --executor ray` is
`tessel.pipeline.run.run_on_ray`: the requests run here, on stage 0.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from tessel.pipeline.executor import ProcessExecutor
from tessel.pipeline.options import RunOptions
from tessel.pipeline.run_plan import RunPlan, load_run_plan
from tessel.pipeline.supervision.launcher import DONE_GRACE_S, POLL_S
from tessel.pipeline.supervision.ray_stages import (
    RayNode,
    RayStages,
    check_placement,
    connect,
    stage_env_for_driver,
    this_node,
)
from tessel.ports import port_of, reserve_port


class RayExecutor(ProcessExecutor):
    """A `ProcessExecutor` whose stages 1..S-1 are Ray actors on the plan's nodes."""

    stages: RayStages | None

    @classmethod
    def spawn(cls, options: RunOptions, run_dir: Path) -> RayExecutor:
        nodes = connect(options.ray_address)
        plan = load_run_plan(options.plan, options.replica)
        here = this_node(nodes)
        check_placement(plan, nodes, here)
        stage_env_for_driver(here.address)
        listener = reserve_port(here.address)  # held until stage 0's store listens on it
        master = (here.address, port_of(listener))
        try:
            stages = _start_stages(options, plan, nodes, master, run_dir) if len(plan.stages) > 1 else None
        except BaseException:
            listener.close()
            raise
        return cls(options, stages, f"tcp://{master[0]}:{master[1]}", listener=listener)

    def finish(self) -> list[dict]:
        """After the last request (`tessel launch`): tell the stages to stop, wait until each has
        written its figures and exited, -> their statuses; then their actors go."""
        statuses: list[dict] = []
        try:
            if self.comm is not None:
                self.comm.close()
                self.comm.send_stop()
                self.comm.flush()
            if self.stages is not None:
                deadline = time.monotonic() + DONE_GRACE_S
                while time.monotonic() < deadline:
                    statuses = self.stages.statuses()
                    if all(s.get("state") == "done" for s in statuses):
                        break
                    time.sleep(POLL_S)
        finally:
            self.comm = None  # sent and flushed: shutdown only stops the actors
            self.shutdown()
        return statuses


def _start_stages(
    options: RunOptions, plan: RunPlan, nodes: dict[str, RayNode], master: tuple[str, int], run_dir: Path
) -> RayStages:
    """Stages 1..S-1 as Ray actors on their nodes, their tessel and torch checked against this one's."""
    data = {**json.loads(options.write(run_dir / "run-options.json").read_text()), "run_dir": None}
    stages = RayStages(json.dumps(data), plan, nodes, master, run_dir, options.heartbeat_timeout)
    try:
        stages.check_versions()
    except BaseException:
        stages.stop()
        raise
    return stages
