"""One dtype vocabulary (tessel.dtypes): both spellings everywhere, int8/fp8 for the planner only (fp8 for
its KV cache alone: the catalog has no fp8 peak to price weights at), each option's help and refusal
written from the list it parses with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import user_error
from typer.testing import CliRunner

from tessel.cli import app
from tessel.dtypes import KV_DTYPES, PLAN_DTYPES, RUNTIME_DTYPES, parse_dtype, runtime_dtype_name
from tessel.errors import TesselError

PAIRS = [("fp32", "float32"), ("bf16", "bfloat16"), ("fp16", "float16"), ("fp16", "half")]


@pytest.mark.parametrize("short,long", PAIRS)
def test_both_spellings_name_one_dtype(short: str, long: str) -> None:
    for runtime in (False, True):
        assert parse_dtype(short, runtime=runtime) == parse_dtype(long, runtime=runtime) == short
        assert parse_dtype(long.upper(), runtime=runtime) == short
    long_name = RUNTIME_DTYPES[short]
    assert runtime_dtype_name(short) == runtime_dtype_name(f"torch.{long_name}") == long_name


@pytest.mark.parametrize("name", ["int8", "fp8", "INT8"])
def test_a_planner_precision_is_refused_by_the_runtime_naming_the_planner(name: str) -> None:
    assert parse_dtype(name, runtime=False, kv=True) == name.lower()
    with pytest.raises(TesselError, match="planner precision .*tessel plan"):
        parse_dtype(name, runtime=True)


def test_fp8_is_a_kv_cache_dtype_not_a_weight_one() -> None:
    assert parse_dtype("fp8", runtime=False, kv=True) == "fp8"
    with pytest.raises(TesselError, match="no fp8 peak FLOP/s .*; use one of float32, .*, int8$"):
        parse_dtype("fp8", runtime=False)


def test_every_offered_precision_is_priced() -> None:
    """Weights at a peak FLOP/s every catalog GPU has; a KV cache by its bytes."""
    from tessel.catalog.gpus import get_gpu, known_gpus
    from tessel.cost.layer import DTYPE_BYTES

    assert set(KV_DTYPES) <= set(DTYPE_BYTES) and set(PLAN_DTYPES) < set(KV_DTYPES)
    assert all(get_gpu(name).peak_flops(dtype) > 0 for name in known_gpus() for dtype in PLAN_DTYPES)


def test_unknown_and_auto() -> None:
    with pytest.raises(TesselError, match="'float64' is not supported; use one of float32, bfloat16"):
        parse_dtype("float64", runtime=True)
    with pytest.raises(TesselError, match="not supported"):
        parse_dtype("auto", runtime=False)
    assert runtime_dtype_name("auto") == "auto"
    with pytest.raises(TesselError, match="not supported"):
        runtime_dtype_name("auto", allow_auto=False)


def test_the_engine_resolves_either_spelling_to_one_torch_dtype() -> None:
    torch = pytest.importorskip("torch")
    from tessel.models.config import ModelConfig, resolve_dtype

    config = ModelConfig.__new__(ModelConfig)
    object.__setattr__(config, "checkpoint_dtype", "bfloat16")
    assert resolve_dtype("bf16", config) is resolve_dtype("bfloat16", config) is torch.bfloat16
    assert resolve_dtype("auto", config) is torch.bfloat16
    with pytest.raises(TesselError, match="planner precision"):
        resolve_dtype("int8", config)


def _unboxed(message: str) -> str:
    """A usage error's text without rich's box (it wraps lines inside `│ ... │`)."""
    return " ".join(message.replace("│", " ").split())


def _plan(tmp_path: Path, *dtype_args: str) -> dict:
    out = tmp_path / f"plan{'-'.join(dtype_args)}.json"
    args = ["plan", "--model", "llama-2-7b", "--cluster", "llmpq-t4-v100", "--solver", "dp", *dtype_args]
    args += ["--json", out]
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, result.output + repr(result.exception)
    document = json.loads(out.read_text())
    document["solver"].pop("time_s")  # the one figure two runs of one plan differ in
    return document


def test_plan_takes_the_long_spelling_as_the_short_one(tmp_path: Path) -> None:
    short = _plan(tmp_path, "--dtype", "bf16", "--kv-dtype", "fp16")
    long = _plan(tmp_path, "--dtype", "bfloat16", "--kv-dtype", "float16")
    assert short["dtype"] == "bf16" and short["kv_dtype"] == "fp16"
    assert short == long


@pytest.mark.parametrize(
    "args",
    [
        ["generate", "--dtype", "int8", "--model", "m", "--prompt", "hi"],
        ["serve", "--dtype", "fp8", "--model", "m"],
        ["embed", "--dtype", "int8", "--model", "m", "--text", "hi"],
        ["launch", "--dtype", "int8", "--plan", "p.json", "--model", "m", "--prompt", "hi"],
        ["profile", "--dtype", "int8", "--tiny-shape", "64,128,4,4"],
    ],
)
def test_runtime_commands_refuse_a_planner_precision_before_they_start(args: list[str]) -> None:
    message = _unboxed(user_error(args))
    assert "planner precision" in message and "float32" in message


@pytest.mark.parametrize("command", ["plan", "chunk"])
def test_planner_commands_refuse_an_unknown_dtype_listing_both_spellings(command: str) -> None:
    message = _unboxed(user_error([command, "--dtype", "float64"]))
    assert all(name in message for name in (*PLAN_DTYPES, "bfloat16"))


def test_every_dtype_option_lists_both_spellings() -> None:
    import typer.main

    group = typer.main.get_command(app)
    found = set()
    for name, command in group.commands.items():
        for param in command.params:
            if any(opt.endswith("dtype") for opt in param.opts):
                found.add(name)
                words = set(param.help.replace(",", " ").replace("(", " ").replace(")", " ").split())
                assert set(RUNTIME_DTYPES) | set(RUNTIME_DTYPES.values()) <= words, (name, param.help)
    assert {"plan", "chunk", "generate", "serve", "embed", "launch", "profile"} <= found


# Every precision name a dtype option could offer (the oracle: what the help says is read from it)
PRECISION_NAMES = {"fp32", "bf16", "fp16", "int8", "fp8", "int4"}
# a time limit no busy machine reaches: the DP reports finding no plan in time as no feasible plan
PLAN_ARGS = ["--model", "llama-2-7b", "--cluster", "llmpq-t4-v100", "--solver", "dp", "--time-limit", "300"]
PLANNER_DTYPE_OPTIONS = [
    ("plan", "--dtype", PLAN_ARGS),
    ("plan", "--kv-dtype", PLAN_ARGS),
    ("chunk", "--dtype", ["--model", "llama-2-7b", "--seq-len", "1024", "--grid", "256"]),
]


def _offered(command: str, option: str) -> set[str]:
    """The precisions an option's --help offers."""
    import typer.main

    params = typer.main.get_command(app).commands[command].params
    (param,) = [p for p in params if option in p.opts]
    return PRECISION_NAMES & set(param.help.replace(",", " ").replace(".", " ").replace(":", " ").split())


@pytest.mark.parametrize("command,option,args", PLANNER_DTYPE_OPTIONS)
def test_a_planner_dtype_option_accepts_all_it_offers_and_refuses_naming_only_that(
    command: str, option: str, args: list[str]
) -> None:
    """What --help offers, the command plans with; what it refuses, the message names the same list
    (issue 42: `tessel plan --dtype fp8` was offered, then refused naming a list without fp8)."""
    offered = _offered(command, option)
    assert {"fp32", "bf16", "fp16"} <= offered
    for name in sorted(offered):
        result = CliRunner().invoke(app, [command, *args, option, name])
        assert result.exit_code == 0, (name, result.output[-600:], repr(result.exception))
    refused = _unboxed(user_error([command, *args, option, "fp64"]))
    named = PRECISION_NAMES & set(refused.replace(",", " ").replace(";", " ").split())
    assert named == offered, refused
