"""Lets the chunk tests import their shared helpers (`chunk_pipelines`)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
