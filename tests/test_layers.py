"""The core's layers, read from the source: each sub-package of ``mcrdl_core`` imports
only from itself and the layers below it, no module of the package imports another of
its modules inside a function (a deferred import hides a cycle or a layer crossed
upwards; only optional third-party libraries are deferred), the modules' imports form
no cycle, the core imports no framework and no backend, and no module of ours reads a
``_private`` name that only another of our modules defines.

The layers, lowest first (``docs/layout.md`` says what each holds)."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CORE = ROOT / "mcrdl_core"

#: sub-packages of mcrdl_core, lowest first; one entry may hold peers (same level)
LAYERS = [("base",), ("engine",), ("memory",), ("world",), ("observe",), ("dispatch",),
          ("compress",), ("algorithms", "reshard"), ("cluster",), ("tools",)]
LEVEL = {name: i for i, names in enumerate(LAYERS) for name in names}
#: what the framework-free core never imports (frontends and backends sit above it)
FOREIGN = ("torch", "jax", "jaxlib", "mpi4jax", "mcrdl_backends", "mcrdl_torch", "mcrdl_jax",
           "mcrdl_autoload")


def _modules(root: pathlib.Path, name: str) -> dict:
    """{dotted module name: path} of a package folder."""
    out = {}
    for p in sorted(root.rglob("*.py")):
        parts = (name,) + p.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules(CORE, "mcrdl_core")


def _imports(mod: str, path: pathlib.Path):
    """(absolute target, node, at module level) for every import in a module."""
    tree = ast.parse(path.read_text())
    package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    functions = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            functions.update(id(n) for n in ast.walk(node) if n is not node)
    for node in ast.walk(tree):
        top = id(node) not in functions
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node, top
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # "from pkg import module" names the module
                full = f"{target}.{alias.name}"
                yield (full if full in MODULES else target), node, top


def _layer(mod: str):
    parts = mod.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LEVEL) else None


def test_every_module_is_in_a_layer():
    stray = [m for m in MODULES if m != "mcrdl_core" and _layer(m) not in LEVEL]
    assert stray == [], f"modules outside the layers {sorted(LEVEL)}: {stray}"


def test_imports_go_down_only():
    bad = []
    for mod, path in MODULES.items():
        here = _layer(mod)
        for target, node, _ in _imports(mod, path):
            if not target.startswith("mcrdl_core.") or mod == "mcrdl_core":
                continue
            there = _layer(target)
            if there is None or here is None:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {target}")
            elif there != here and LEVEL[there] >= LEVEL[here]:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {here} imports {target} "
                           f"({there} is not below it)")
    assert bad == [], "\n".join(bad)


def test_no_deferred_import_of_the_package():
    bad = [f"{path.relative_to(ROOT)}:{node.lineno} imports {target} inside a function"
           for mod, path in MODULES.items() for target, node, top in _imports(mod, path)
           if not top and target.startswith("mcrdl_core")]
    assert bad == [], "\n".join(bad)


def test_no_import_cycle():
    graph = {m: {t for t, _, _ in _imports(m, p) if t in MODULES and t != m}
             for m, p in MODULES.items()}
    state: dict = {}

    def visit(m, stack):
        state[m] = "open"
        for t in sorted(graph[m]):
            if t.startswith(m + "."):  # a package importing its own submodules
                continue
            if state.get(t) == "open":
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t, stack + [t])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_the_core_imports_no_framework_and_no_backend():
    bad = [f"{path.relative_to(ROOT)}:{node.lineno} imports {target}"
           for mod, path in MODULES.items() for target, node, _ in _imports(mod, path)
           if target.split(".")[0] in FOREIGN]
    assert bad == [], "\n".join(bad)


# --- private names ----------------------------------------------------------------------
OURS = {**MODULES, **_modules(ROOT / "backends", "mcrdl_backends"),
        **_modules(ROOT / "frontends" / "torch", "mcrdl_torch"),
        **_modules(ROOT / "frontends" / "jax", "mcrdl_jax"),
        **_modules(ROOT / "frontends" / "autoload", "mcrdl_autoload")}


#: torch.distributed's private API, which the "mcrdl" process group implements and the Gloo
#: backend calls on torch's own process groups: torch's names, not ours
TORCH_API = {"_allgather_base", "_reduce_scatter_base", "_source_rank"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _defined(tree) -> set:
    """The private names a module defines: functions, classes, assignments at any level,
    attributes it assigns (``self._x = ``, ``obj._x = ``), parameters."""
    names = set()
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            names.add(n.id)
        elif isinstance(n, ast.Attribute) and isinstance(n.ctx, (ast.Store, ast.Del)):
            names.add(n.attr)
        elif isinstance(n, ast.arg):
            names.add(n.arg)
        elif isinstance(n, ast.alias):
            names.add(n.asname or n.name.split(".")[0])
        elif isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setattr" and \
                len(n.args) > 1 and isinstance(n.args[1], ast.Constant):
            names.add(n.args[1].value)
    return {x for x in names if isinstance(x, str) and _private(x)}


def test_no_module_reads_another_modules_private_names():
    trees = {m: ast.parse(p.read_text()) for m, p in OURS.items()}
    defined = {m: _defined(t) for m, t in trees.items()}
    anywhere = set().union(*defined.values())
    bad = []
    for mod, tree in trees.items():
        path = OURS[mod].relative_to(ROOT)
        for n in ast.walk(tree):
            if isinstance(n, ast.Attribute) and _private(n.attr):
                # another object's private name that this module does not define itself
                # (torch's own private API is not ours: only names we define count)
                if n.attr in anywhere - TORCH_API and n.attr not in defined[mod]:
                    bad.append(f"{path}:{n.lineno} reads .{n.attr}")
            elif isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith(
                    ("mcrdl_core", "mcrdl_backends", "mcrdl_torch", "mcrdl_jax", "mcrdl_autoload"))):
                bad.extend(f"{path}:{n.lineno} imports {a.name}" for a in n.names
                           if _private(a.name))
    assert bad == [], "\n".join(bad)
