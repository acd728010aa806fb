"""`tessel list`, and runtime commands in a planner-only install (torch missing): exit 2 with the install
line, never a ModuleNotFoundError traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from tessel.catalog.models import PRESETS
from tessel.cli import RUNTIME_INSTALL, app


@pytest.mark.parametrize(
    "what,expected",
    [("models", next(iter(PRESETS))), ("clusters", "mixed-a100-v100-t4"), ("workloads", "default")],
)
def test_list_names_what_the_commands_take(what, expected):
    result = CliRunner().invoke(app, ["list", what])
    assert result.exit_code == 0 and expected in result.output.split()


def test_list_refuses_an_unknown_kind():
    assert CliRunner().invoke(app, ["list", "gpus-and-more"]).exit_code == 2


BLOCK_TORCH = "import sys; sys.modules['torch'] = None; sys.argv = ['tessel'] + sys.argv[1:]; "


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "--model", "{dir}", "--prompt", "hi"],
        ["serve", "--model", "{dir}"],
        ["embed", "--model", "{dir}", "--text", "hi"],
    ],
)
def test_runtime_commands_without_torch_exit_2_with_the_install_line(args, tmp_path):
    argv = [a.replace("{dir}", str(tmp_path)) for a in args]
    code = BLOCK_TORCH + "from tessel.cli import main; main()"
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    message = " ".join(done.stderr.split())
    assert RUNTIME_INSTALL in message and f"tessel {args[0]}" in message and "Traceback" not in done.stderr
