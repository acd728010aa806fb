"""HiGHS prints nothing of its own (issue 27): its banner ("Running HiGHS 1.x ...") is written from C
to the process's stdout by the first solver constructed, before any option can be set; it used to
come before `tessel plan`'s tables and before its one-line errors. Run as subprocesses: the banner
goes to file descriptor 1, which in-process capture of sys.stdout would not see.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BANNER = "HiGHS"  # neither the tables nor the errors of `tessel plan` name the solver's library


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)


def _plan(*args: str) -> subprocess.CompletedProcess:
    return _run("-m", "tessel.cli", "plan", "--time-limit", "5", *args)


def test_a_successful_plan_prints_no_banner() -> None:
    """The default solver: the DP's LP bounds in this process and HiGHS's MILP in a child."""
    result = _plan("--model", "llama-2-7b", "--cluster", "local-cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("llama-2-7b on local-cpu"), result.stdout[:300]
    assert BANNER not in result.stdout and BANNER not in result.stderr


def test_a_failing_plan_prints_its_error_alone(tmp_path: Path) -> None:
    """No plan meets a zero quality budget on two T4s (fp16 does not fit, int4 costs quality):
    the error comes after HiGHS has solved, and is all the command prints."""
    cluster = tmp_path / "two-t4.yaml"
    cluster.write_text("name: two-t4\nnodes:\n  - name: n0\n    gpus: {type: T4, count: 2}\n")
    args = ("--model", "llama-3-8b", "--cluster", str(cluster), "--precisions", "fp16,int4")
    result = _plan(*args, "--quality-budget", "0")
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert result.stderr.startswith("error: no plan meets the quality budget 0"), result.stderr
    assert BANNER not in result.stderr


def test_the_first_solver_of_a_process_is_silent_and_stdout_comes_back() -> None:
    code = (
        "from tessel.plan.solvers.highs import new_highs, solve_lp\n"
        "print('before', flush=True)\n"
        "new_highs(); new_highs(verbose=False)\n"
        "print('value', solve_lp([1.0], [1.0], [2.0], [0], [0], [1.0], [0.0], [5.0]))\n"
    )
    result = _run("-c", code)
    assert result.returncode == 0, result.stderr
    assert result.stdout == "before\nvalue 1.0\n" and result.stderr == ""
