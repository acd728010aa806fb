"""kernels/ and layers/ import nothing above them (issue 28): not the quantisation toolkit, the models,
the engine, the server, the pipeline runtime or the CLI. What they need of the CPU (which int8 path
is fast here) lives in `tessel.kernels.cpu_features`; a layer's weight rounding in the layers. The
runtime (engine, models, pipeline, server) imports nothing from the offline toolkit `tessel.quant`."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import tessel

SRC = Path(tessel.__file__).parent
ABOVE = ("quant", "models", "engine", "server", "pipeline", "commands", "cli")


def _imported_modules(path: Path) -> Iterator[str]:
    """Every absolute module an import statement of `path` names, function-level imports included."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            yield from (f"{node.module}.{alias.name}" for alias in node.names)


def _above(module: str) -> bool:
    parts = module.split(".")
    return len(parts) > 1 and parts[0] == "tessel" and parts[1] in ABOVE


@pytest.mark.parametrize("package", ["kernels", "layers"])
def test_kernels_and_layers_import_nothing_above_them(package: str) -> None:
    files = sorted((SRC / package).rglob("*.py"))
    assert files
    upward = [
        f"{path.relative_to(SRC)} imports {module}"
        for path in files
        for module in _imported_modules(path)
        if _above(module)
    ]
    assert upward == []


@pytest.mark.parametrize("package", ["engine", "models", "pipeline", "server"])
def test_the_runtime_imports_nothing_from_the_offline_toolkit(package: str) -> None:
    """The runtime half of quantisation lives in `tessel.models.quantized` (and GGUF in, in
    `tessel.models.gguf`); `tessel.quant` is the offline toolkit, which may import the runtime."""
    files = sorted((SRC / package).rglob("*.py"))
    assert files
    toolkit = [
        f"{path.relative_to(SRC)} imports {module}"
        for path in files
        for module in _imported_modules(path)
        if module.split(".")[:2] == ["tessel", "quant"]
    ]
    assert toolkit == []


def test_the_check_sees_every_import_form(tmp_path: Path) -> None:
    source = tmp_path / "m.py"
    source.write_text(
        "import tessel.engine.engine_config\nfrom tessel import quant\n"
        "def f():\n    from tessel.server.app import create_app\n"
        "from tessel.kernels import rms_norm\nfrom .sibling import x\n"
    )
    found = [module for module in _imported_modules(source) if _above(module)]
    server = ["tessel.server.app", "tessel.server.app.create_app"]
    assert found == ["tessel.engine.engine_config", "tessel.quant", *server]
