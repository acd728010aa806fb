"""The YAML reader's bound on the values of a file (`tessel.catalog.yaml_reader.MAX_YAML_VALUES`, issue 42):
a file written out past it is refused naming the field that holds them, how many and the limit, and
only aliases are blamed when aliases made it; the reader stops at the bound (a syntax error past it is
never reached) instead of reading the whole file first."""

from __future__ import annotations

import random
import re
from pathlib import Path

import pytest
from cli_helpers import user_error
from hypothesis import given, settings
from hypothesis import strategies as st

from tessel.catalog.yaml_reader import MAX_YAML_VALUES
from tessel.errors import TesselError
from tessel.plan.files.cluster import load_cluster

BOUND = f"the file more than {MAX_YAML_VALUES}"
LIMIT = f"tessel reads at most {MAX_YAML_VALUES} from a YAML file"


def _node(index: int, schedule_pairs: int = 0) -> list[str]:
    lines = [f"  - name: n{index}", "    gpus: {type: T4, count: 1}", "    host_memory_gib: 16"]
    if schedule_pairs:
        lines += ["    emulate:", "      schedule:"]
        lines += [f"        - [{second}.5, 0.{random.randint(1, 9)}]" for second in range(schedule_pairs)]
    return lines


def _cluster(nodes: int, long_node: int = -1, pairs: int = 0) -> str:
    lines = ["name: big", "nodes:"]
    for index in range(nodes):
        lines += _node(index, pairs if index == long_node else 0)
    return "\n".join(lines) + "\n"


@settings(max_examples=4, deadline=None)
@given(nodes=st.integers(1, 4), data=st.data(), extra=st.integers(1, 3 * MAX_YAML_VALUES))
def test_a_long_schedule_is_refused_naming_it(tmp_path_factory, nodes, data, extra) -> None:
    """Each pair is three values (the list and its two numbers): more than the bound in one field."""
    long_node = data.draw(st.integers(0, nodes - 1))
    pairs = MAX_YAML_VALUES // 3 + extra // 3 + 1
    text = _cluster(nodes, long_node, pairs)
    path = tmp_path_factory.mktemp("yaml") / "cluster.yaml"
    path.write_text(text + "  - {broken: [\n")  # past the bound: a reader that stops there never sees it
    with pytest.raises(TesselError) as refused:
        load_cluster(path)
    message = str(refused.value)
    line = text.splitlines().index("      schedule:") + 2  # where its value, the list, begins
    where = re.escape(f"nodes[{long_node}].emulate.schedule")
    assert re.fullmatch(
        rf"{path}:{line}: {where} holds \d+ values, {BOUND} .*; {LIMIT}: shorten {where}", message
    )
    held = int(re.search(r"holds (\d+) values", message).group(1))
    assert MAX_YAML_VALUES // 3 <= held <= MAX_YAML_VALUES and "alias" not in message


def test_a_probe_merge_of_many_nodes_is_refused_naming_the_nodes(tmp_path: Path) -> None:
    nodes = MAX_YAML_VALUES // 11 + random.randint(1, 20_000)  # 11 values a node
    parts = []
    for name in ("a", "b"):
        parts.append(tmp_path / f"{name}.yaml")
        parts[-1].write_text(_cluster(nodes))
    message = user_error(["probe", "--merge", parts[0], "--merge", parts[1]])
    assert re.search(rf"{parts[0]}:3: nodes holds \d+ values, {BOUND} .*{LIMIT}: shorten nodes", message), (
        message
    )


def test_an_alias_bomb_is_refused_naming_its_aliases(tmp_path: Path) -> None:
    from hostile import YAML_BOMB

    path = tmp_path / "bomb.yaml"
    path.write_text(YAML_BOMB)
    with pytest.raises(
        TesselError, match=rf"{path}:\d+: f holds \d+ values, {BOUND}, its YAML aliases expanded"
    ):
        load_cluster(path)


def test_a_file_at_the_bound_is_read(tmp_path: Path) -> None:
    """The bound counts what a file holds: just under it the file is read, and its fields checked (a
    schedule of that many changes is then refused by its own rule)."""
    pairs = (MAX_YAML_VALUES - 30) // 3
    path = tmp_path / "cluster.yaml"
    path.write_text(_cluster(1, 0, pairs))
    with pytest.raises(TesselError, match=rf"nodes\[0\]\.emulate\.schedule: {pairs} speed changes; at most"):
        load_cluster(path)
