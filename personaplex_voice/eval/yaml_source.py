"""YAML that remembers where each value came from, so every complaint names a file and a line.

`load(path)` returns plain Python values, except that mappings are `Located` dicts and lists are
`LocatedList`s: both know their own line and the line of each key or item (1-based). Scalars are
the usual `yaml.safe_load` ones. Duplicate keys are refused (YAML would silently keep the last).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from personaplex_voice.errors import UserError


class ScenarioError(UserError):
    """A scenario file that cannot be used: the message is `file:line: problem`, one line."""

    def __init__(self, where: str, problem: str):
        super().__init__(f"{where}: {problem}")
        self.where = where
        self.problem = problem


class Located(dict):
    """A YAML mapping with its line and each key's line."""

    file: str = "?"
    line: int = 0
    key_lines: dict[Any, int]

    def where(self, key: Any = None) -> str:
        line = self.key_lines.get(key, self.line) if key is not None else self.line
        return f"{self.file}:{line}"


class LocatedList(list):
    """A YAML sequence with its line and each item's line."""

    file: str = "?"
    line: int = 0
    item_lines: list[int]

    def where(self, index: int | None = None) -> str:
        line = self.item_lines[index] if index is not None and index < len(self.item_lines) else self.line
        return f"{self.file}:{line}"


def _loader_for(file: str) -> type[yaml.SafeLoader]:
    class LineLoader(yaml.SafeLoader):
        pass

    def mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> Located:
        loader.flatten_mapping(node)
        out = Located()
        out.file, out.line, out.key_lines = file, node.start_mark.line + 1, {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                raise ScenarioError(
                    f"{file}:{key_node.start_mark.line + 1}", "a key must be a plain value"
                ) from None
            if key in out:
                raise ScenarioError(f"{file}:{key_node.start_mark.line + 1}", f"duplicate key {key!r}")
            out[key] = loader.construct_object(value_node, deep=True)
            out.key_lines[key] = key_node.start_mark.line + 1
        return out

    def sequence(loader: yaml.SafeLoader, node: yaml.SequenceNode) -> LocatedList:
        out = LocatedList(loader.construct_object(child, deep=True) for child in node.value)
        out.file, out.line = file, node.start_mark.line + 1
        out.item_lines = [child.start_mark.line + 1 for child in node.value]
        return out

    LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    LineLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_SEQUENCE_TAG, sequence)
    return LineLoader


def load(path: Path) -> Any:
    """The file's single YAML document with line information; ScenarioError when it cannot be
    read or parsed."""
    shown = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ScenarioError(shown, "no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ScenarioError(shown, f"cannot read it ({exc})") from None
    try:
        return yaml.load(text, Loader=_loader_for(shown))  # a SafeLoader subclass
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line = mark.line + 1 if mark is not None else 1
        problem = " ".join(str(part) for part in (exc.context, exc.problem) if part)
        raise ScenarioError(f"{shown}:{line}", f"not valid YAML ({problem})") from None
    except yaml.YAMLError as exc:
        raise ScenarioError(shown, f"not valid YAML ({exc})") from None
