"""Tensor-parallel fixtures: tiny checkpoints built once, torch on one thread."""

from engine_fixtures import _one_thread, checkpoints  # noqa: F401
