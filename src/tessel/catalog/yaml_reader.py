"""Reading a user's YAML file into a pydantic model, with errors that name the file and the line.

pydantic reports where a value is wrong as a location (`("nodes", 1, "gpus", "type")`); the YAML
node tree keeps the line of every value, so the two together give `cluster.yaml:9: nodes[1].gpus.type`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from types import UnionType
from typing import TypeVar, Union, get_args, get_origin

import pydantic
import yaml

from tessel.errors import TesselError
from tessel.files import check_nesting, read_text_file

# Most values a YAML file may hold, its aliases expanded (a cluster or workload file holds a few
# hundred): refuses "billion laughs" alias bombs, and files far past any cluster, before they are read.
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
        _check_value_count(text, label)
        tree = yaml.compose(text)
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


def _check_value_count(text: str, label: str) -> None:
    """Refuse YAML holding more than MAX_YAML_VALUES values (each key, item and scalar, an alias counted
    as what it expands to), naming the field that holds most of them. Reads parser events and stops at
    the bound: bounded work (libyaml's parser where PyYAML has it) before anything composes the file.
    libyaml refusing what PyYAML reads: counted again with PyYAML's parser, whose errors are the reader's."""
    for loader in _EVENT_LOADERS:
        try:
            _count_values(yaml.parse(text, Loader=loader), label)
            return
        except yaml.YAMLError:
            if loader is _EVENT_LOADERS[-1]:
                raise


_EVENT_LOADERS = (*([yaml.CSafeLoader] if hasattr(yaml, "CSafeLoader") else []), yaml.SafeLoader)


@dataclass(slots=True)
class _Collection:
    """A mapping or sequence the counter is inside: where it is, and the counts when it began."""

    path: str
    line: int
    values_before: int
    aliased_before: int
    anchor: str | None
    mapping: bool
    next_is_key: bool = True
    key: str = "?"
    items: int = 0

    def child_path(self) -> str:
        """The path of the node that comes next in this collection (a key's own path is its mapping's)."""
        if not self.mapping:
            return f"{self.path}[{self.items}]"
        return f"{self.path}.{self.key}" if self.path else self.key


def _count_values(events: Iterable[yaml.Event], label: str) -> None:
    values = aliased = 0  # values read so far; of them, those aliases stood for
    sizes: dict[str, int] = {}  # anchor -> the values its node holds
    open_: list[_Collection] = []
    for event in events:
        if isinstance(event, yaml.CollectionEndEvent):
            done = open_.pop()
            if done.anchor is not None:
                sizes[done.anchor] = values - done.values_before
            continue
        if not isinstance(event, yaml.NodeEvent):
            continue
        parent = open_[-1] if open_ else None
        is_key = parent is not None and parent.mapping and parent.next_is_key
        path = parent.child_path() if parent is not None else ""
        if isinstance(event, yaml.AliasEvent):
            count = sizes.get(event.anchor, 1)  # an alias inside its own anchor's node counts once
            values, aliased = values + count, aliased + count
        else:
            values += 1
            if isinstance(event, yaml.CollectionStartEvent):
                line = event.start_mark.line + 1
                mapping = isinstance(event, yaml.MappingStartEvent)
                open_.append(_Collection(path, line, values - 1, aliased, event.anchor, mapping))
            elif event.anchor is not None:
                sizes[event.anchor] = 1
        if parent is not None:
            if is_key:
                parent.key = event.value if isinstance(event, yaml.ScalarEvent) else "?"
            elif not parent.mapping:
                parent.items += 1
            parent.next_is_key = not is_key if parent.mapping else True
        if values > MAX_YAML_VALUES:
            raise TesselError(_too_many_values(open_, values, aliased, label))


def _too_many_values(open_: list[_Collection], values: int, aliased: int, label: str) -> str:
    """The refusal, naming the innermost collection that holds a third or more of what was read (its
    line: where its value begins) and how much it holds."""
    where = next((c for c in reversed(open_) if 3 * (values - c.values_before) >= values), None)
    line = where.line if where is not None else 1
    name = where.path if where is not None and where.path else "the file"
    if where is None or not where.path:
        problem = f"holds more than {MAX_YAML_VALUES} values"
    else:
        problem = f"holds {values - where.values_before} values, the file more than {MAX_YAML_VALUES}"
    if aliased > (where.aliased_before if where is not None else 0):
        problem, fix = f"{problem}, its YAML aliases expanded", "use fewer aliases"
    else:
        problem, fix = f"{problem} (keys, items and scalars)", f"shorten {name}"
    return f"{label}:{line}: {name} {problem}; tessel reads at most {MAX_YAML_VALUES} from a YAML file: {fix}"


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
