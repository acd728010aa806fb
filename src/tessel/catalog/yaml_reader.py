"""Reading a user's YAML file into a pydantic model, with errors that name the file and the line.

pydantic reports where a value is wrong as a location (`("nodes", 1, "gpus", "type")`); the YAML
node tree keeps the line of every value, so the two together give `cluster.yaml:9: nodes[1].gpus.type`.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from types import UnionType
from typing import TypeVar, Union, get_args, get_origin

import pydantic
import yaml

from tessel.errors import TesselError
from tessel.files import check_nesting, read_text_file

# Most values a YAML file may expand to once its aliases are followed (a cluster or workload file
# holds a few hundred): refuses "billion laughs" alias bombs before anything walks the values.
MAX_YAML_VALUES = 100_000

ModelT = TypeVar("ModelT", bound=pydantic.BaseModel)


def bundled_names(folder: str) -> list[str]:
    """Names (without .yaml) of the files bundled in tessel/catalog/<folder>/."""
    root = resources.files("tessel.catalog").joinpath(folder)
    return sorted(entry.name[: -len(".yaml")] for entry in root.iterdir() if entry.name.endswith(".yaml"))


def resolve_file(path_or_name: str | Path, folder: str, kind: str) -> tuple[str, str]:
    """(text, label) of a path that exists, else of a bundled file of that name."""
    path = Path(path_or_name).expanduser()
    if path.exists():
        return read_text_file(path, f"{kind} file"), str(path)
    name = str(path_or_name).strip()
    name = name[: -len(".yaml")] if name.endswith(".yaml") else name
    if name in bundled_names(folder):
        entry = resources.files("tessel.catalog").joinpath(folder, f"{name}.yaml")
        return entry.read_text(), f"{name}.yaml (bundled)"
    raise TesselError(
        f"{kind} file {str(path_or_name)!r} not found; give a path to a YAML file or one of the bundled "
        f"{kind}s: {', '.join(bundled_names(folder))}"
    )


def parse_yaml(text: str, label: str, model_cls: type[ModelT]) -> ModelT:
    """Validate YAML text as `model_cls`; errors say file:line: field: what is wrong."""
    check_nesting(text, label)
    try:
        tree = yaml.compose(text)
        _check_expanded_size(tree, label)
        data = yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        line = f":{mark.line + 1}" if mark is not None else ""
        raise TesselError(f"{label}{line}: not valid YAML ({error.problem})") from None
    except yaml.YAMLError as error:  # ReaderError: control characters, invalid code points
        raise TesselError(f"{label}: not valid YAML ({error})") from None
    except (RecursionError, ValueError, OverflowError) as error:  # e.g. a float too large for a timestamp
        raise TesselError(f"{label}: not valid YAML ({str(error)[:200]})") from None
    if not isinstance(data, dict):
        raise TesselError(f"{label}: expected a YAML mapping of fields at the top level")
    try:
        return model_cls.model_validate(data)
    except pydantic.ValidationError as error:
        raise TesselError(_format_errors(error, tree, label, model_cls)) from None


def _check_expanded_size(tree: yaml.Node | None, label: str) -> None:
    """Refuse YAML whose aliases expand to more than MAX_YAML_VALUES values."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        sizes[id(node)] = 1  # a recursive alias counts once
        if isinstance(node, yaml.MappingNode):
            total = 1 + sum(size(key) + size(value) for key, value in node.value)
        elif isinstance(node, yaml.SequenceNode):
            total = 1 + sum(size(item) for item in node.value)
        else:
            total = 1
        sizes[id(node)] = min(total, MAX_YAML_VALUES + 1)
        return sizes[id(node)]

    if tree is not None and size(tree) > MAX_YAML_VALUES:
        raise TesselError(
            f"{label}: expands to more than {MAX_YAML_VALUES} values (YAML aliases); write the values out"
        )


def validate_data(data: dict, label: str, model_cls: type[ModelT]) -> ModelT:
    """Validate an already-parsed mapping (no line numbers)."""
    try:
        return model_cls.model_validate(data)
    except pydantic.ValidationError as error:
        raise TesselError(_format_errors(error, None, label, model_cls)) from None


def _format_errors(
    error: pydantic.ValidationError, tree: yaml.Node | None, label: str, model_cls: type[pydantic.BaseModel]
) -> str:
    lines = []
    for item in error.errors(include_url=False):
        location = tuple(item["loc"])
        where = _dotted(location) or "(top level)"
        line = _line_of(tree, location) if tree is not None else None
        prefix = f"{label}:{line}" if line is not None else label
        message = item["msg"].removeprefix("Value error, ")
        if item["type"] == "extra_forbidden":
            allowed = _allowed_fields(model_cls, location[:-1])
            message = "unknown field" + (f"; allowed: {', '.join(allowed)}" if allowed else "")
        lines.append(f"{prefix}: {where}: {message}")
    return "\n".join(lines)


def _allowed_fields(model_cls: type, location: tuple) -> list[str]:
    """Field names of the pydantic model found at `location` (through lists), if any."""
    current: object = model_cls
    for part in location:
        while get_origin(current) in (list, Union, UnionType) or isinstance(current, UnionType):
            models = [arg for arg in get_args(current) if arg is not type(None)]
            current = models[0] if models else None
        fields = getattr(current, "model_fields", None)
        if isinstance(part, int) or fields is None:
            continue
        current = fields[part].annotation if part in fields else None
    while get_origin(current) in (list, Union, UnionType) or isinstance(current, UnionType):
        models = [arg for arg in get_args(current) if arg is not type(None)]
        current = models[0] if models else None
    return list(getattr(current, "model_fields", {}))


def _dotted(location: tuple) -> str:
    text = ""
    for part in location:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _line_of(tree: yaml.Node, location: tuple) -> int:
    """1-based line of the deepest YAML node the location reaches."""
    node = tree
    for part in location:
        child = _child(node, part)
        if child is None:
            break
        node = child
    return node.start_mark.line + 1


def _child(node: yaml.Node, part: str | int) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if key.value == str(part):
                return value
    if isinstance(node, yaml.SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
        return node.value[part]
    return None
