"""Reading users' input files and writing tessel's output files, with user errors instead of tracebacks.

Every reader of a user's file (cluster, workload, model config.json, profile, plan, trace) goes
through `read_text_file`, so a missing file, a directory, a binary or non-UTF-8 file and a file
too large to be an input all raise `TesselError` naming the file; `parse_json_text` does the same
for broken or too deeply nested JSON.

Writers never destroy what tessel did not write. A file output goes through `check_output_path`
(before the work, so a bad `--json DIR` costs nothing; never one of the command's own input files)
and `write_text_file` / `write_json_file` / `staged_file` (atomic: a temporary file beside it
replaces it only once complete; JSON has no NaN: non-finite floats become null). A directory output
goes through `check_output_directory` (before the work) and `staged_directory`: it is built in a
fresh directory beside the target, which holds the marker file `OUTPUT_MARKER`, and moved into
place at the end. An existing target is refused unless it is empty, or `overwrite` is given and
it holds the marker (tessel wrote it); the input, a folder holding the input, the current
directory, the home directory and `/` are always refused. `claim_directory` applies the same rule
to a folder tessel writes its files into (`launch --run-dir`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from tessel.errors import TesselError

# Largest input file read (bytes). The biggest real inputs are request traces: a million-row
# CSV trace is about 25 MiB; cluster, workload, model and plan files are a few KiB.
MAX_INPUT_FILE_BYTES = 64 * 2**20
# Deepest nesting of JSON / YAML containers accepted; tessel's own files nest at most 4 deep, and
# Python's parsers recurse per level (the default recursion limit is 1000).
MAX_NESTING_DEPTH = 64
_BINARY_SNIFF_BYTES = 8192
# The file tessel writes into every output directory it creates: `--overwrite` replaces only a
# directory that holds it, so an output path naming a user's own folder never removes it.
OUTPUT_MARKER = ".tessel-output"
_MARKER_TEXT = (
    "Written by tessel. `tessel ... --overwrite` may replace this directory; delete this file to "
    "keep tessel from ever replacing it.\n"
)


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


def read_nonempty_text_file(path: str | Path, what: str, max_bytes: int = MAX_INPUT_FILE_BYTES) -> str:
    """`read_text_file`, refusing a file with nothing but white space (a calibration or training text)."""
    text = read_text_file(path, what, max_bytes)
    if not text.strip():
        raise TesselError(f"{what} {Path(path).expanduser()} is empty; give a UTF-8 text file")
    return text


def parse_json_text(text: str, label: str) -> object:
    """JSON text as Python values; syntax errors and excessive nesting become `TesselError`."""
    check_nesting(text, label)
    try:
        return json.loads(text)
    except json.JSONDecodeError as error:
        unclosed = text.rstrip()[-1:] not in ("}", "]")  # an object or array file cut short
        last = text.rstrip().count("\n") + 1
        ends = f"; it ends unclosed at line {last}: truncated?" if unclosed else ""
        where = f"line {error.lineno}: {error.msg} at column {error.colno}{ends}"
        raise TesselError(f"{label}: not valid JSON ({where})") from None
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


def check_output_path(path: str | Path, what: str, inputs: Iterable[str | Path | None] = ()) -> Path:
    """Refuse a file output path that is a directory, one of the command's `inputs`, or whose folder
    cannot be written, before any work. An existing file is replaced (atomically) at the end."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise TesselError(
            f"cannot write {what} {path}: it is a directory; give a file name (e.g. {path / 'out.json'})"
        )
    for item in _existing(inputs):
        if _same_file(path, item):
            raise TesselError(
                f"{what} {path} is also an input of this command ({item}); write to another file"
            )
    if path.exists() and not path.is_file():
        raise TesselError(f"{what} {path} exists and is not a regular file; give a new file name")
    _check_folder(path, what)
    if path.exists() and not os.access(path, os.W_OK):
        raise TesselError(f"{what} {path} is not writable")
    return path


def check_output_directory(
    target: str | Path, what: str, *, inputs: Iterable[str | Path | None] = (), overwrite: bool = False
) -> Path:
    """Refuse a directory output that would destroy anything tessel did not write, before any work.

    Refused always: the inputs, a folder holding one, the current directory, the home directory, /
    (or a folder holding them), a symbolic link and an existing non-directory. An existing non-empty
    directory is refused unless `overwrite` is given and it holds `OUTPUT_MARKER`."""
    target = Path(target).expanduser()
    _refuse_protected(target, what, inputs)
    if target.is_symlink():
        raise TesselError(f"{what} {target} is a symbolic link; give the path of a new directory")
    if target.exists() and not target.is_dir():
        raise TesselError(f"{what} {target} exists and is not a directory; give the path of a new directory")
    if target.is_dir() and not _is_empty(target):
        if not overwrite:
            raise TesselError(f"{what} {target} already exists; pass --overwrite to replace it")
        if not (target / OUTPUT_MARKER).is_file():
            raise TesselError(
                f"{what} {target} was not written by tessel (it has no {OUTPUT_MARKER}); tessel replaces "
                "only its own output directories: give a new path or remove it yourself"
            )
    _check_folder(target, what)
    return target


def claim_directory(folder: str | Path, what: str, *, inputs: Iterable[str | Path | None] = ()) -> Path:
    """A folder tessel writes its files into (created, marked): new, empty, or marked by tessel before."""
    folder = Path(folder).expanduser()
    _refuse_protected(folder, what, inputs)
    if folder.exists() and (folder.is_symlink() or not folder.is_dir()):
        raise TesselError(f"{what} {folder} exists and is not a directory; give a new or empty folder")
    if folder.is_dir() and not _is_empty(folder) and not (folder / OUTPUT_MARKER).is_file():
        raise TesselError(
            f"{what} {folder} holds files tessel did not write (it has no {OUTPUT_MARKER}); "
            "give a new or empty folder"
        )
    _check_folder(folder, what)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        _mark(folder)
    except OSError as error:
        raise TesselError(f"cannot write {what} {folder}: {error.strerror or error}") from None
    return folder


def _existing(inputs: Iterable[str | Path | None]) -> list[Path]:
    """The inputs that name something on disk (a bundled name such as a cluster preset does not)."""
    out = []
    for item in inputs:
        if item is not None and str(item):
            path = Path(item).expanduser()
            if path.exists():
                out.append(path)
    return out


def _same_file(path: Path, other: Path) -> bool:
    """The same file: by inode where `path` exists (hard links too), else by its resolved spelling."""
    try:
        if path.exists():
            return os.path.samefile(path, other)
    except OSError:
        pass
    return _real(path) == _real(other)


def _real(path: Path) -> Path:
    return Path(os.path.realpath(path))


def _protected(inputs: Iterable[str | Path | None]) -> list[tuple[Path, str]]:
    """(path, how to name it) of every place an output must neither be nor hold."""
    places = [(Path("/"), "the root directory /")]
    for name, where in (("your home directory", Path.home), ("the current directory", Path.cwd)):
        try:
            places.append((where(), name))
        except (OSError, RuntimeError):  # no HOME / the current directory was removed
            pass
    places += [(path, f"an input of this command ({path})") for path in _existing(inputs)]
    return places


def _refuse_protected(target: Path, what: str, inputs: Iterable[str | Path | None]) -> None:
    where = _real(target)
    for place, name in _protected(inputs):
        real = _real(place)
        if where == real:
            raise TesselError(f"{what} {target} is {name}; tessel never writes over it: give a new path")
        if real.is_relative_to(where):
            raise TesselError(f"{what} {target} holds {name}; tessel never writes over it: give a new path")


def _is_empty(folder: Path) -> bool:
    try:
        return next(os.scandir(folder), None) is None
    except OSError as error:
        raise TesselError(f"cannot read {folder}: {error.strerror or error}") from None


def _check_folder(path: Path, what: str) -> None:
    """The nearest existing folder above `path` must be a folder tessel can write in."""
    existing = next((p for p in path.parents if p.exists()), None)
    if existing is None:
        return
    if not existing.is_dir():
        raise TesselError(f"{what} {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise TesselError(f"{what} {path}: the folder {existing} is not writable")


def jsonable(value: object) -> object:
    """The value with inf / nan (not valid JSON) replaced by null, tuples as lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(item) for item in value]
    return value


def write_json_file(
    path: str | Path, document: object, what: str = "output file", inputs: Iterable[str | Path | None] = ()
) -> Path:
    """Write `document` as indented JSON (non-finite floats as null), creating the folder; atomic."""
    return write_text_file(path, json.dumps(jsonable(document), indent=2) + "\n", what, inputs)


def write_text_file(
    path: str | Path, text: str, what: str = "output file", inputs: Iterable[str | Path | None] = ()
) -> Path:
    """Write `text` (UTF-8) to `path` atomically, creating the folder."""
    with staged_file(path, what, inputs) as staging:
        staging.write_text(text, encoding="utf-8")
    return Path(path).expanduser()


@contextlib.contextmanager
def staged_file(
    path: str | Path, what: str = "output file", inputs: Iterable[str | Path | None] = ()
) -> Iterator[Path]:
    """A temporary file beside `path` (same suffix) that replaces it only when the block succeeds.

    An interrupted write leaves the previous file (or none), never half a document, and no
    temporary file behind."""
    path = check_output_path(path, what, inputs)
    staging = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(
            dir=path.parent, prefix=f".{path.name}.partial-", suffix=path.suffix
        )
        os.close(handle)
        os.chmod(staging, 0o666 & ~_umask())  # mkstemp's 0600 -> what open() would have given
        yield Path(staging)
        os.replace(staging, path)
    except OSError as error:
        raise TesselError(f"cannot write {what} {path}: {error.strerror or error}") from None
    finally:
        if staging is not None and os.path.exists(staging):
            os.unlink(staging)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def staged_directory(
    target: str | Path,
    what: str = "output directory",
    *,
    inputs: Iterable[str | Path | None] = (),
    overwrite: bool = False,
) -> Iterator[Path]:
    """A fresh marked directory beside `target` that takes its place only when the block succeeds.

    `target` is checked by `check_output_directory` before and again after the block (the work may
    take minutes). A target that exists is renamed aside, the new directory moved in, then the old
    one removed: only ever a directory holding `OUTPUT_MARKER`, or an empty one. A failed or
    interrupted run leaves the old target intact and no staging behind."""
    target = check_output_directory(target, what, inputs=inputs, overwrite=overwrite)
    staging = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.partial-"))
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp's 0700 -> what mkdir would have given
        _mark(staging)
        yield staging
        check_output_directory(target, what, inputs=inputs, overwrite=overwrite)
        _move_into_place(staging, target)
    except OSError as error:
        raise TesselError(f"cannot write {what} {target}: {error.strerror or error}") from None
    finally:
        if staging is not None and staging.exists():
            shutil.rmtree(staging, ignore_errors=True)  # tessel's own staging, never the target


def _mark(folder: Path) -> None:
    (folder / OUTPUT_MARKER).write_text(_MARKER_TEXT, encoding="utf-8")


def _move_into_place(staging: Path, target: Path) -> None:
    """Rename `staging` to `target`; an existing target (checked: empty or marked) goes aside first."""
    if not os.path.lexists(target):
        os.rename(staging, target)  # fails, keeping both, if a non-empty target appeared meanwhile
        return
    aside = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.old-"))
    os.rename(target, aside)  # onto the empty `aside`
    try:
        os.rename(staging, target)
    except OSError:
        os.rename(aside, target)  # the old output back where it was
        raise
    if (aside / OUTPUT_MARKER).is_file():
        shutil.rmtree(aside)
    else:  # it was empty when checked; if it gained files since, they stay (under the .old- name)
        with contextlib.suppress(OSError):
            aside.rmdir()
