"""The package's import graph: no circle between colo modules and nothing that
imports from a higher layer, read from the source (AST), every ``import`` and
``from ... import`` anywhere in a module, inside functions too.

The layers, lowest first. A module may import its own layer and the ones
below it, never one above:

0. ``colo.core`` — the pure core (phases, invariants, ledger, buckets, errors);
1. leaves on torch alone or plain files: ``colo.dtypes``, ``colo.digest`` (the verification
   contract every engine meets), ``colo.tasks``, ``colo.blocking`` (colo from synchronous code),
   ``colo.models`` (what each architecture's checkpoint holds: data every side reads),
   ``colo.proc`` (the channel, handles, process lifetime), ``colo.trace``;
2. what reads traces or devices and drives sides: ``colo.offline``, ``colo.device``,
   ``colo.groups``, ``colo.scheduler``, ``colo.verification`` (the digest and the probe);
3. ``colo.transports``;
4. what an engine or a trainer is made of: ``colo.extractors``, ``colo.engine``;
5. ``colo.trainers``;
6. ``colo.ranks`` (a trainer rank and an engine rank per process), ``colo.testing``;
7. the applications and the front door: ``colo.apps``, ``colo.cli``, ``colo`` itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

import colo

ROOT = Path(colo.__file__).parent

LAYERS: list[tuple[str, ...]] = [
    ("colo.core",),
    ("colo.dtypes", "colo.digest", "colo.tasks", "colo.blocking", "colo.models", "colo.proc", "colo.trace"),
    ("colo.offline", "colo.device", "colo.groups", "colo.scheduler", "colo.verification"),
    ("colo.transports",),
    ("colo.extractors", "colo.engine"),
    ("colo.trainers",),
    ("colo.ranks", "colo.testing"),
    ("colo.apps", "colo.cli", "colo"),
]


def modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The colo modules ``name`` imports anywhere (a name imported from a package that is a
    module of its own counts as that module)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets = [module] + [f"{module}.{a.name}" for a in node.names]
        else:
            continue
        for t in targets:
            if not (t == "colo" or t.startswith("colo.")):
                continue
            while t not in known and "." in t:
                t = t.rsplit(".", 1)[0]
            if t in known and t != name:
                found.add(t)
    return found


def layer_of(module: str) -> int:
    best, layer = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, layer = len(p), i
    assert layer is not None, f"{module} is in no layer: add it to LAYERS"
    return layer


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {m: imports_of(m, p, set(mods)) for m, p in mods.items()}


def test_every_module_has_a_layer():
    for m in modules():
        layer_of(m)


def test_nothing_imports_from_a_higher_layer():
    climbs = sorted(f"{m} (layer {layer_of(m)}) imports {t} (layer {layer_of(t)})"
                    for m, targets in graph().items() for t in targets if layer_of(t) > layer_of(m))
    assert climbs == []


def test_no_import_circles():
    g = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(g[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    assert circles == []


def test_the_check_sees_imports_inside_functions(tmp_path):
    # the checker itself: an import inside a function body is an import
    path = tmp_path / "m.py"
    path.write_text("def f():\n    from colo.apps import demo\n    import colo.engine.kit\n")
    assert imports_of("colo.core.m", path, {"colo.apps.demo", "colo.engine.kit", "colo.core.m"}) == \
        {"colo.apps.demo", "colo.engine.kit"}
