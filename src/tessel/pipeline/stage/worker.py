"""A pipeline stage process: `python -m tessel.pipeline.stage.worker --plan plan.json --model DIR ...`.

The entry point starts the stage's heartbeat (`tessel.pipeline.supervision.heartbeat`) before
anything heavy is imported, so a stage stopped or stuck while Python imports torch, while it loads
its layers or while it joins the process group is seen by the watchdog like one stopped while
serving; then it runs the stage (`tessel.pipeline.stage.process`). This module imports no torch.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tessel.errors import TesselError
from tessel.pipeline.supervision.heartbeat import (
    RUN_DIR_ENV,
    Heartbeat,
    StageProgress,
    beat_interval_s,
    heartbeat_timeout_s,
)


def start_heartbeat(rank: int) -> Heartbeat | None:
    """The stage's heartbeat thread, under a launcher (`TESSEL_RUN_DIR` set); None under torchrun."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return None
    heartbeat = Heartbeat(
        Path(run_dir), rank, beat_interval_s(heartbeat_timeout_s()), StageProgress("starting")
    )
    return heartbeat.start()


def main(argv: list[str] | None = None) -> int:
    rank = int(os.environ.get("RANK", "0"))
    try:
        heartbeat = start_heartbeat(rank)
    except TesselError as error:  # a bad TESSEL_HEARTBEAT_TIMEOUT_S
        print(f"tessel stage {rank}: error: {error}", file=sys.stderr)
        return error.exit_code
    from tessel.pipeline.stage.process import run_stage_process  # torch: after the first beat

    return run_stage_process(argv, heartbeat)


if __name__ == "__main__":
    sys.exit(main())
