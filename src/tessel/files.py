"""Reading users' input files and writing tessel's output files, with user errors instead of tracebacks.

Every reader of a user's file (cluster, workload, model config.json, profile, plan, trace) goes
through `read_text_file`, so a missing file, a directory, a binary or non-UTF-8 file and a file
too large to be an input all raise `TesselError` naming the file; `parse_json_text` does the same
for broken or too deeply nested JSON. Every writer goes through `check_output_path` (before the
work, so a bad `--json DIR` costs nothing) and `write_json_file` (JSON has no NaN: non-finite
floats become null).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tessel.errors import TesselError

# Largest input file read (bytes). The biggest real inputs are request traces: a million-row
# CSV trace is about 25 MiB; cluster, workload, model and plan files are a few KiB.
MAX_INPUT_FILE_BYTES = 64 * 2**20
# Deepest nesting of JSON / YAML containers accepted; tessel's own files nest at most 4 deep, and
# Python's parsers recurse per level (the default recursion limit is 1000).
MAX_NESTING_DEPTH = 64
_BINARY_SNIFF_BYTES = 8192


def read_text_file(path: str | Path, what: str, max_bytes: int = MAX_INPUT_FILE_BYTES) -> str:
    """The UTF-8 text of a user's file; `what` names it in errors ("cluster file", "trace")."""
    path = Path(path).expanduser()
    if not path.exists():
        raise TesselError(f"{what} {path} does not exist")
    if path.is_dir():
        raise TesselError(f"{what} {path} is a directory; give the path of a file")
    try:
        size = path.stat().st_size
        if size > max_bytes:
            raise TesselError(
                f"{what} {path} is {size / 2**20:.1f} MiB; tessel reads input files of at most "
                f"{max_bytes / 2**20:.0f} MiB"
            )
        with path.open("rb") as handle:
            data = handle.read(max_bytes + 1)
    except OSError as error:
        raise TesselError(f"cannot read {what} {path}: {error.strerror or error}") from None
    if len(data) > max_bytes:  # grew while read, or a device file with no size
        raise TesselError(f"{what} {path}: more than {max_bytes / 2**20:.0f} MiB; not an input file")
    if b"\x00" in data[:_BINARY_SNIFF_BYTES]:
        raise TesselError(f"{what} {path} is a binary file, not text")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise TesselError(
            f"{what} {path} is not UTF-8 text (byte {error.start}: {data[error.start]:#04x}); "
            "save it as UTF-8"
        ) from None


def parse_json_text(text: str, label: str) -> object:
    """JSON text as Python values; syntax errors and excessive nesting become `TesselError`."""
    check_nesting(text, label)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        raise TesselError(f"{label}: not valid JSON (line {error.lineno}: {error.msg})") from None
    except (RecursionError, ValueError) as error:  # ValueError: an integer of > 4300 digits
        raise TesselError(f"{label}: not valid JSON ({str(error)[:200]})") from None


def read_json_file(path: str | Path, what: str) -> object:
    return parse_json_text(read_text_file(path, what), str(path))


def check_nesting(text: str, label: str) -> None:
    """Refuse text whose brackets nest deeper than MAX_NESTING_DEPTH.

    An upper bound: brackets inside strings count too, which no tessel input has in numbers.
    """
    if text.count("[") + text.count("{") <= MAX_NESTING_DEPTH:
        return  # cannot nest deeper (the common case: no per-character scan)
    depth = deepest = 0
    for char in text:
        if char in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif char in "]}":
            depth = max(0, depth - 1)
    if deepest > MAX_NESTING_DEPTH:
        raise TesselError(f"{label}: nested {deepest} levels deep; at most {MAX_NESTING_DEPTH} are accepted")


def check_output_path(path: str | Path, what: str) -> Path:
    """Refuse an output path that is a directory or whose folder cannot be written, before any work."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise TesselError(f"{what} {path} is a directory; give a file name (e.g. {path / 'out.json'})")
    folder = path.parent
    existing = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        raise TesselError(f"{what} {path}: {existing} is a file, not a folder")
    if path.exists() and not os.access(path, os.W_OK):
        raise TesselError(f"{what} {path} is not writable")
    return path


def jsonable(value: object) -> object:
    """The value with inf / nan (not valid JSON) replaced by null, tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    return value


def write_json_file(path: str | Path, document: object, what: str = "output file") -> Path:
    """Write `document` as indented JSON (non-finite floats as null), creating the folder.

    Atomic: the text goes to a temporary file beside `path` that replaces it only once complete, so
    an interrupted write leaves the previous file (or none), never half a document."""
    path = check_output_path(path, what)
    text = json.dumps(jsonable(document), indent=2) + "\n"
    staging = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.partial-")
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.chmod(staging, 0o666 & ~_umask())  # mkstemp's 0600 -> what open() would have given
        os.replace(staging, path)
    except OSError as error:
        raise TesselError(f"cannot write {what} {path}: {error.strerror or error}") from None
    finally:
        if staging is not None and os.path.exists(staging):
            os.unlink(staging)
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def staged_directory(target: str | Path) -> Iterator[Path]:
    """A temporary directory beside `target` that replaces it only when the block succeeds.

    A failed or interrupted run leaves nothing half-written at `target` (and no staging behind)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-"))
    try:
        yield staging
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
