"""The package's shape, checked over its source (every import at any depth, lazy ones included):
no import cycle, no module importing a layer above it, and a session's state written only where
the scheduler keeps it."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "personaplex_voice"

# Lower numbers sit lower: a module may import its own layer and the ones below it.
LAYERS: dict[str, int] = {
    "errors": 0,
    "metrics": 0,
    "untrusted": 0,
    "audio": 0,
    "model": 1,
    "engine": 2,
    "session_api": 3,
    "sessions": 3,
    "process": 4,
    "server": 5,
    "cluster": 5,
    "cli_options": 6,
    "serve_command": 6,
    "offline": 6,
    "voices_cli": 6,
    "deploy": 6,
    "eval": 6,
    "cli": 6,
}
# What cluster/ may take from server/: the ASGI app a front-end serves.
CLUSTER_MAY_IMPORT_FROM_SERVER = {"personaplex_voice.server.app"}
# The one module that writes a session's state.
STATE_OWNER = "personaplex_voice.engine.scheduler.records"
STATE_FIELDS = {"state", "slot", "queue_position", "close_reason", "closed", "ready_now", "was_ready"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import in the module, at any depth; `from X import Y`
    counts as importing X.Y when that is a module of the package, else X."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                yield (full if full in MODULES else source), node.lineno


def internal_imports(name: str) -> set[str]:
    found = set()
    for target, _ in imports_of(name):
        while target and target not in MODULES:
            target = target.rpartition(".")[0]
        if target.startswith("personaplex_voice") and target != name and target != "personaplex_voice":
            found.add(target)
    return found


def layer_of(name: str) -> int:
    top = name.split(".")[1] if "." in name else name
    return LAYERS[top]


def test_every_module_has_a_layer():
    unknown = sorted(n for n in MODULES if n != "personaplex_voice" and n.split(".")[1] not in LAYERS)
    assert not unknown, f"give these a layer in LAYERS: {unknown}"


def test_no_module_imports_a_layer_above_it():
    wrong = []
    for name in MODULES:
        if name == "personaplex_voice":
            continue
        for target in internal_imports(name):
            if layer_of(target) > layer_of(name):
                wrong.append(f"{name} -> {target}")
    assert not wrong, "\n".join(wrong)


def test_server_knows_nothing_of_the_cluster_and_the_cluster_only_the_app_of_the_server():
    wrong = []
    for name in MODULES:
        for target in internal_imports(name):
            if name.startswith("personaplex_voice.server") and target.startswith("personaplex_voice.cluster"):
                wrong.append(f"{name} -> {target}")
            if (
                name.startswith("personaplex_voice.cluster")
                and target.startswith("personaplex_voice.server")
                and target not in CLUSTER_MAY_IMPORT_FROM_SERVER
            ):
                wrong.append(f"{name} -> {target}")
    assert not wrong, "\n".join(wrong)


def test_there_is_no_import_cycle():
    graph = {name: internal_imports(name) for name in MODULES}
    # A package's __init__ re-exporting its own modules is not a cycle of the design.
    for name, targets in graph.items():
        if MODULES[name].name == "__init__.py":
            graph[name] = {t for t in targets if not t.startswith(name + ".")}
    seen: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> None:
        seen[node] = 1
        stack.append(node)
        for target in sorted(graph.get(node, ())):
            if seen.get(target) == 1:
                cycle = [*stack[stack.index(target) :], target]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if target not in seen:
                visit(target)
        stack.pop()
        seen[node] = 2

    for name in sorted(graph):
        if name not in seen:
            visit(name)


def state_writes(path: Path) -> Iterator[str]:
    """Assignments that write a session's state: `x.state = ...` on any object but `self`, and
    `self.<field> = ...` or `self._<field> = ...` inside a class named *Session*."""
    tree = ast.parse(path.read_text(), str(path))
    for cls in [None, *[n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]]:
        body = tree if cls is None else cls
        in_session = cls is not None and "Session" in cls.name
        for node in ast.walk(body):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            for target in targets:
                if not isinstance(target, ast.Attribute):
                    continue
                field = target.attr.lstrip("_")
                on_self = isinstance(target.value, ast.Name) and target.value.id == "self"
                if field in STATE_FIELDS and (not on_self or in_session):
                    where = f"{path.relative_to(ROOT)}:{node.lineno}"
                    yield f"{where} writes {ast.unparse(target)}"


def test_only_the_scheduler_records_write_a_sessions_state():
    wrong = []
    for name, path in MODULES.items():
        if name != STATE_OWNER:
            wrong.extend(state_writes(path))
    for path in sorted((ROOT / "bridges").rglob("*.py")):
        wrong.extend(state_writes(path))
    assert not wrong, "\n".join(sorted(set(wrong)))
    assert list(state_writes(MODULES[STATE_OWNER])), "the check found the owner's own writes"
