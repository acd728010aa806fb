"""The planner side must import (and `tessel plan` must run) without torch installed."""

from __future__ import annotations

import subprocess
import sys

# Make `import torch` fail in the child, as on a machine with only `pip install tessel`.
_BLOCK_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'triton', 'transformers'):
            raise ImportError('blocked for the test: ' + name)
        return None
sys.meta_path.insert(0, _NoTorch())
"""

PLANNER_MODULES = (
    "tessel",
    "tessel.catalog",
    "tessel.cost",
    "tessel.plan",
    "tessel.chunk",
    "tessel.sim",
    "tessel.units",
    "tessel.cli",
)


def test_planner_side_imports_without_torch() -> None:
    code = _BLOCK_TORCH + "".join(f"\nimport {name}" for name in PLANNER_MODULES)
    code += "\nimport pkgutil, importlib\n"
    code += (
        "for pkg in ('tessel.catalog','tessel.cost','tessel.plan','tessel.chunk','tessel.sim'):\n"
        "    mod = importlib.import_module(pkg)\n"
        "    for info in pkgutil.walk_packages(mod.__path__, pkg + '.'):\n"
        "        importlib.import_module(info.name)\n"
        "assert 'torch' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
