"""The package's structure, read from its source: layers that import one way, no import cycle (function-local
imports included), units a reader holds in one sitting."""
import ast
import pathlib
import sys

import networkx as nx
import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "autocastfx"

# lowest first: a module may import from its own layer (without a cycle) and from the layers below it
LAYERS = {
    "base": 0,          # shared vocabulary: meta keys, TensorInfo, ConvertInfo, ConvertOptions, runtime helpers
    "core": 1,          # passes over one captured graph
    "capture": 2,       # model -> graph module (trace, torch.export, programs per mode, inline, around)
    "converted": 3,     # the converted module's class and runtime: modes, calls, the model's surface
    "tree": 4,          # blocks and piecewise conversion, given the per-graph conversion as callbacks
    "api": 5,           # convert()
    "training": 6,      # autocastfx's step, scaling, CUDA graphs, data parallel, sharding, checkpoints
    "tools": 6,         # report, graph, diagnose, inference, export, cli
    "integrations": 7,  # Lightning, Hugging Face
    "": 8,              # the package's __init__, __main__ and the autocastfx.lightning alias
}
# training and tools share a rank and must not import each other
SIBLINGS_APART = {("training", "tools"), ("tools", "training")}

MAX_FUNCTION_LINES = 80
MAX_CLASS_LINES = 200
# names with a leading underscore that one module takes from another of the package (``from .x import _f`` or
# ``x._f`` on an imported module): a name another module needs is part of its module's interface, and says so
MAX_PRIVATE_IMPORTS = 0


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _imports(name: str, path: pathlib.Path, modules: dict) -> set[str]:
    """The package modules ``name`` imports, at any depth of its code (function-local imports too)."""
    out = set()
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            elif node.module and node.module.split(".")[0] == "autocastfx":
                target = node.module
            else:
                continue
            found = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            out |= set(found) if found else {target}
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "autocastfx"}
    return {m for m in out if m in modules and m != name}


def _graph() -> nx.DiGraph:
    modules = _modules()
    g = nx.DiGraph()
    for name, path in modules.items():
        g.add_node(name)
        for target in _imports(name, path, modules):
            g.add_edge(name, target)
    return g


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return ""
    if parts[1] in LAYERS:
        return parts[1]
    return "" if parts[1] in ("__main__", "lightning") else parts[1]


def test_every_package_is_listed_for_installation():
    """pyproject.toml names the packages an install copies: a folder missing there is missing from a wheel."""
    import re
    text = (PACKAGE.parent / "pyproject.toml").read_text()
    listed = set(re.findall(r'"(autocastfx(?:\.\w+)*)"', text.split("packages =", 1)[1].split("]", 1)[0]))
    found = {_module_name(p.parent / "__init__.py") for p in PACKAGE.rglob("__init__.py")}
    assert found == listed, f"packages not listed: {sorted(found - listed)}; listed, not found: {sorted(listed - found)}"


def test_every_module_is_in_a_known_layer():
    unknown = sorted(m for m in _modules() if _layer(m) not in LAYERS)
    assert not unknown, f"modules outside the layers {sorted(LAYERS)}: {unknown} (add a layer or move them)"


def test_no_import_cycle():
    g = _graph()
    g.remove_node("autocastfx")  # the package's __init__ imports everything it exports: nothing imports it back
    cycles = [sorted(c) for c in nx.strongly_connected_components(g) if len(c) > 1]
    assert not cycles, f"import cycles: {cycles}"
    assert "autocastfx" not in {t for _, t in _graph().edges}, "a module imports the package's __init__"


def test_imports_point_down_the_layers():
    upward = []
    for source, target in _graph().edges:
        a, b = _layer(source), _layer(target)
        if LAYERS[b] > LAYERS[a] or (a, b) in SIBLINGS_APART:
            upward.append(f"{source} -> {target}")
    assert not upward, "imports from a higher layer:\n" + "\n".join(sorted(upward))


@pytest.mark.parametrize("kind", ["function", "class"])
def test_units_are_short(kind):
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if kind == "function" and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                    and size > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({size} lines)")
            if kind == "class" and isinstance(node, ast.ClassDef) and size > MAX_CLASS_LINES:
                long.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name} ({size} lines)")
    limit = MAX_FUNCTION_LINES if kind == "function" else MAX_CLASS_LINES
    assert not long, f"{kind}s over {limit} lines:\n" + "\n".join(long)


def _private_imports(root: pathlib.Path) -> list[str]:
    """Every use, in a module of the package, of another package module's underscored name."""
    out = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        modules = set()  # local names bound to the package's modules or names
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("autocastfx")):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        out.append(f"{path.relative_to(root)}:{node.lineno} from {node.module or '.'} import {a.name}")
                    else:
                        modules.add(a.asname or a.name)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                    and node.attr.startswith("_") and not node.attr.startswith("__"):
                out.append(f"{path.relative_to(root)}:{node.lineno} {node.value.id}.{node.attr}")
    return out


def test_few_private_names_cross_modules():
    found = _private_imports(PACKAGE)
    assert len(found) <= MAX_PRIVATE_IMPORTS, \
        f"{len(found)} private names taken across modules (at most {MAX_PRIVATE_IMPORTS}):\n" + "\n".join(found)


def test_the_private_import_count_sees_both_spellings(tmp_path):
    pkg = tmp_path / "autocastfx"
    (pkg / "core").mkdir(parents=True)
    (pkg / "core" / "plan.py").write_text("def _f():\n    pass\n")
    (pkg / "api.py").write_text("from .core import plan as p\nfrom .core.plan import _f\np._f()\n")
    assert sorted(_private_imports(pkg)) == ["api.py:2 from core.plan import _f", "api.py:3 p._f"]


def test_the_layering_check_sees_a_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """The checks above can fail: a package with a cycle through a function-local import and an upward import."""
    pkg = tmp_path / "autocastfx"
    (pkg / "core").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "__init__.py").write_text("")
    (pkg / "api.py").write_text("from .core import plan\n")
    (pkg / "core" / "plan.py").write_text("def f():\n    from ..api import g\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", pkg)
    g = _graph()
    assert ("autocastfx.core.plan", "autocastfx.api") in g.edges
    assert any(len(c) > 1 for c in nx.strongly_connected_components(g))
    with pytest.raises(AssertionError, match="core.plan -> autocastfx.api"):
        test_imports_point_down_the_layers()
