"""Issue 42, done: every numeric option of every command, given 0, a negative number, NaN, inf, 1e-12,
1e300 or a huge integer, ends in bounded time with exit code 0 or 2 (a user error with a message),
never a traceback, never a hang.

The options come from the typer app itself (`tessel.cli.COMMANDS` and their type hints), so an option
added later is fuzzed without a change here, and a command with numeric options but no base
invocation in `BASES` fails `test_every_command_with_numeric_options_has_a_base`. Each case is the
command's cheap valid base invocation with the fuzzed option appended (the last occurrence of an
option wins), after whatever makes that option matter (`Base.extra`). A value the option itself
refuses must be refused while the whole command line is parsed, naming the option, before the
command body runs (`test_numeric_option_refused_as_parsed`, the fast tier). A value it accepts runs
the command for real (`test_numeric_option_ends_in_success_or_a_user_error`, `slow`): in-process
under a time guard, or, for a command that starts processes (`launch`), as a subprocess in a session
of its own, killed past its timeout. The guards catch hangs only; nothing here measures time.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import typer
import typer.main
from cli_helpers import run_tessel_process, succeeds_or_user_error, time_guard

import tiny_models
from tessel.cli import COMMANDS, app

VALUES = ("0", "-1", "nan", "inf", "-inf", "1e-12", "1e300", str(10**30))
IN_PROCESS_GUARD_S = 300.0  # a hang, not a slow run: the slowest accepted case takes seconds
SUBPROCESS_TIMEOUT_S = 600.0
CLICK_APP = typer.main.get_command(app)
CLICK_COMMANDS = CLICK_APP.commands


@dataclass(frozen=True)
class Base:
    """A cheap invocation that succeeds, words split on spaces; `{name}` fields are filled from the
    `files` fixture after the split."""

    command_line: str
    extra: dict[str, str] = field(default_factory=dict)  # option -> what makes it matter
    subprocess: bool = False  # the command starts processes: run it as one, with a timeout


_PRECISIONS = "--precisions fp16,int8"
_REPLAN = "--replan-from {sim_plan}"
_STATIC = "--scheme w8a8 --act static --calib {calib} --calib-samples 2 --seq-len 8"
BASES: dict[str, Base] = {
    "plan": Base(
        "plan --model llama-2-7b --cluster llmpq-t4-v100 --solver dp --time-limit 5",
        extra={
            "--time-limit": "--solver milp",
            "--mip-gap": "--solver milp",
            "--quality-budget": _PRECISIONS,
            "--theta": _PRECISIONS,
            "--replan-threshold": _REPLAN,
            "--replan-horizon-s": _REPLAN,
            "--max-concurrency": "--concurrency memory",
        },
    ),
    "probe": Base(
        "probe --merge {cluster_a} {cluster_b} --out {tmp}/merged.yaml "
        "--network-gbps 10 --network-latency-us 5"
    ),
    "serve": Base("serve --model {model} --enforce-eager --kv-cache-gib 0.01"),
    "generate": Base("generate --model {model} --prompt hi --max-tokens 2 --enforce-eager"),
    "simulate": Base(
        "simulate --plan {sim_plan} --requests 2 --remap auto",
        extra={"--gantt-until-s": "--gantt {tmp}/g.svg"},
    ),
    "profile": Base(  # the smallest valid budget: see test_profile_cases_use_the_smallest_budget
        "profile --tiny-shape 64,128,4,2 --components layer --budget-s 0.01 --repeats 1 --warmup 0 "
        "--max-chunk 64 --max-offset 256 --json {tmp}/p.json"
    ),
    "chunk": Base("chunk --model llama-3-8b --stages 2 --seq-len 256"),
    "launch": Base("launch --plan {tiny_plan} --model {model} --prompt hi --max-tokens 2", subprocess=True),
    "quantize": Base(
        "quantize {model} --out {tmp}/q --scheme w8a16",
        extra={
            "--calib-samples": _STATIC,
            "--seq-len": _STATIC,
            "--group-size": "--scheme w4a16",
            "--weight-code-bits": "--scheme w8a8",
        },
    ),
    "qat": Base(
        "qat {model} --out {tmp}/q --train {calib} --steps 1 --seq-len 8 --scheme w8a16",
        extra={"--group-size": "--scheme w4a16"},
    ),
    "embed": Base("embed --model {encoder} --text hi", extra={"--dimensions": "--matryoshka"}),
}


def _kinds(name: str, param) -> set:  # noqa: ANN001 (a typer parameter)
    """The types a command's parameter takes, None left out (`float | None` -> {float})."""
    hint = typing.get_type_hints(COMMANDS[name])[param.name]
    return set(typing.get_args(hint)) - {type(None)} or {hint}


def numeric_options(name: str, kinds: frozenset = frozenset({int, float})) -> list[str]:
    """The command's options whose type is among `kinds` (or it or None), hidden ones too."""
    return [
        param.opts[0]
        for param in CLICK_COMMANDS[name].params
        if param.param_type_name == "option" and _kinds(name, param) <= kinds
    ]


def refused_when_parsed(name: str, option: str, value: str) -> bool:
    """Whether typer refuses `option value` itself (its type, range or callback), before the body."""
    command = CLICK_COMMANDS[name]
    param = next(p for p in command.params if option in p.opts)
    context = command.make_context(name, [], resilient_parsing=True)
    try:
        param.process_value(context, value)
    except typer.BadParameter:
        return True
    except Exception:  # noqa: BLE001 - another exception is a bug the case itself reports
        return False
    return False


def _cases(refused: bool) -> list:
    """(command, option, value) for every numeric option and value the option refuses (or accepts)."""
    return [
        pytest.param(name, option, value, id=f"{name}{option}={value}")
        for name in COMMANDS
        for option in numeric_options(name)
        for value in VALUES
        if refused_when_parsed(name, option, value) == refused
    ]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """What the bases name: a tiny Llama and a one-stage plan of it, a planner plan, a tiny encoder,
    a text, two machines' cluster files."""
    import json

    from encoder_models import make_tiny_bert
    from pipeline_plans import write_plan
    from tessel.plan.api import PlanSettings, make_plan

    root = tmp_path_factory.mktemp("numeric-fuzz")
    model = tiny_models.make_tiny_checkpoint(root / "tiny", "llama", seed=7)
    layers = json.loads((model / "config.json").read_text())["num_hidden_layers"]
    sim_plan = root / "sim_plan.json"
    make_plan("llama-2-7b", "llmpq-t4-v100", "default", PlanSettings(solver="dp")).plan_file().write(sim_plan)
    calib = root / "calib.txt"
    calib.write_text(tiny_models.CORPUS * 4)
    clusters = {}
    for machine in ("a", "b"):
        clusters[f"cluster_{machine}"] = root / f"{machine}.yaml"
        clusters[f"cluster_{machine}"].write_text(
            f"name: {machine}\nnodes:\n  - name: {machine}\n    gpus: {{type: T4, count: 1}}\n"
        )
    return {
        "model": model,
        "tiny_plan": write_plan(root / "tiny_plan.json", model, [(0, layers)], micro_batches=1),
        "sim_plan": sim_plan,
        "encoder": make_tiny_bert(root / "encoder", max_seq_length=12),
        "calib": calib,
        **clusters,
    }


@pytest.fixture
def no_serving(monkeypatch: pytest.MonkeyPatch) -> None:
    """`tessel serve` returns where it would start serving: every option has been checked by then."""
    import uvicorn

    monkeypatch.setattr(uvicorn.Server, "run", lambda self: None)


@pytest.fixture
def torch_threads():  # noqa: ANN201
    """A command run in-process may set torch's thread count (--threads): put it back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _float_options() -> list:
    return [
        pytest.param(name, option, id=f"{name}{option}")
        for name in COMMANDS
        for option in numeric_options(name, frozenset({float}))
    ]


@pytest.mark.parametrize(("name", "option"), _float_options())
def test_every_float_option_names_nan_and_shows_both_bounds(name: str, option: str) -> None:
    """Issue 42, item 8: NaN was refused as "Input should be less than or equal to 1024" (or 1, or
    1e6), and --help showed [x<=1024.0] without the floor the value must reach."""
    command = CLICK_COMMANDS[name]
    param = next(p for p in command.params if option in p.opts)
    context = command.make_context(name, [], resilient_parsing=True)
    with pytest.raises(typer.BadParameter, match="^NaN is not a number; give one in "):
        param.process_value(context, "nan")
    with pytest.raises(typer.BadParameter, match="is not finite"):
        param.process_value(context, "inf")
    assert param.min is not None and param.max is not None, f"tessel {name} {option}: give both bounds"
    below = param.min - max(abs(param.min), 1.0)
    with pytest.raises(typer.BadParameter, match=f"is below {param.min:g}"):
        param.process_value(context, str(below))
    assert f"{param.min}<=x<={param.max}" in param.get_help_record(context)[1]


def test_profile_cases_use_the_smallest_budget() -> None:
    """`tessel profile` times for --budget-s: its base asks for the least it accepts."""
    budget = next(p for p in CLICK_COMMANDS["profile"].params if "--budget-s" in p.opts)
    assert f"--budget-s {budget.min:g} " in BASES["profile"].command_line


def test_every_command_with_numeric_options_has_a_base() -> None:
    missing = [name for name in COMMANDS if numeric_options(name) and name not in BASES]
    assert not missing, f"give {missing} a cheap valid invocation in BASES"
    assert numeric_options("launch")[:2] == ["--max-tokens", "--temperature"]  # the introspection works


def _args(name: str, option: str, value: str, files: dict[str, Path], tmp_path: Path) -> list[str]:
    base = BASES[name]
    fields = {key: str(path) for key, path in files.items()} | {"tmp": str(tmp_path)}
    words = f"{base.command_line} {base.extra.get(option, '')}".split()
    return [word.format(**fields) for word in words] + [option, value]


@pytest.mark.parametrize(("name", "option", "value"), _cases(refused=True))
def test_numeric_option_refused_as_parsed(
    name: str, option: str, value: str, files: dict[str, Path], tmp_path: Path
) -> None:
    """The whole command line is parsed (every other option valid) and refused naming the option, with
    exit code 2, before the command body runs."""
    args = _args(name, option, value, files, tmp_path)
    with time_guard(IN_PROCESS_GUARD_S), pytest.raises(typer.BadParameter) as refused:
        CLICK_APP.main(args, prog_name="tessel", standalone_mode=False)
    assert refused.value.exit_code == 2 and option in refused.value.format_message(), args


@pytest.mark.slow
@pytest.mark.parametrize(("name", "option", "value"), _cases(refused=False))
def test_numeric_option_ends_in_success_or_a_user_error(
    name: str, option: str, value: str, files: dict[str, Path], tmp_path: Path, no_serving, torch_threads
) -> None:
    args = _args(name, option, value, files, tmp_path)
    if not BASES[name].subprocess:
        succeeds_or_user_error(args, guard_s=IN_PROCESS_GUARD_S)
        return
    result = run_tessel_process(args, timeout_s=SUBPROCESS_TIMEOUT_S, cwd=tmp_path)
    assert result.returncode in (0, 2) and "Traceback" not in result.stderr, (args, result.stderr[-3000:])
    if result.returncode == 2:
        assert "error" in result.stderr.lower(), result.stderr[-2000:]
