"""Strict YAML loading for cards and skill frontmatter: no anchors or aliases, no duplicate keys,
dates kept as strings, and every error names the key path of the offender."""

from __future__ import annotations

from typing import Any, Iterable

import yaml
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, SequenceNode

__all__ = ["StrictYAMLError", "keypath", "load_strict_yaml", "yaml_error_text"]


class StrictYAMLError(ValueError):
    """A YAML document broke a strict-loading rule; `.path` is the key path to the offender."""

    def __init__(self, path: list, message: str, line: int | None = None):
        self.path = list(path)
        self.message = message
        self.line = line
        where = keypath(self.path) or "top level"
        at = f" (line {line})" if line else ""
        super().__init__(f"{where}: {message}{at}")


def keypath(path: Iterable) -> str:
    """`["a", 2, "b"]` -> `a[2].b`."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects anchors, aliases and duplicate keys, and keeps dates as strings."""

    def __init__(self, stream):
        super().__init__(stream)
        self._path: list = []

    def compose_node(self, parent, index):
        event = self.peek_event()
        pushed = isinstance(parent, SequenceNode) or (isinstance(parent, MappingNode) and index is not None)
        if pushed:
            self._path.append(index if isinstance(parent, SequenceNode) else getattr(index, "value", index))
        line = event.start_mark.line + 1
        if isinstance(event, AliasEvent):
            raise StrictYAMLError(self._path, f"YAML alias *{event.anchor} is not allowed; write the value out", line)
        if getattr(event, "anchor", None) is not None:
            raise StrictYAMLError(self._path, f"YAML anchor &{event.anchor} is not allowed", line)
        node = super().compose_node(parent, index)
        if pushed:
            self._path.pop()
        return node

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        seen: set = set()
        for key, _ in node.value:
            if key.value in seen:
                raise StrictYAMLError([*self._path, key.value], "duplicate key", key.start_mark.line + 1)
            seen.add(key.value)
        return node


# Dates stay strings so that a bad date is a schema error with a key path, not a crash.
_StrictLoader.add_constructor("tag:yaml.org,2002:timestamp", yaml.SafeLoader.construct_yaml_str)


def load_strict_yaml(text: str) -> Any:
    """Parse one YAML document strictly: no anchors/aliases, no duplicate keys, dates as strings.

    Raises StrictYAMLError (a ValueError) naming the key path, or yaml.YAMLError on bad syntax.
    """
    loader = _StrictLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def yaml_error_text(exc: yaml.YAMLError) -> str:
    """`line N: invalid YAML: <problem>` for a syntax error (the line when PyYAML knows it)."""
    mark = getattr(exc, "problem_mark", None)
    line = f"line {mark.line + 1}: " if mark else ""
    return f"{line}invalid YAML: {getattr(exc, 'problem', None) or exc}"
