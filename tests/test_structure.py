"""The package's structure, read from its source (nothing is imported): the layers of docs/architecture.md.

Every `import` and `from ... import` counts, at module level or inside a function (an import hidden in a
function is still a dependency; only `if TYPE_CHECKING:` blocks are left out). Checked:
- no import cycle between modules;
- no two top-level packages that import each other;
- every import between top-level packages goes down or sideways in LAYERS, never up;
- no module over 600 lines.
"""

from __future__ import annotations

import ast
import collections
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "shardspeed"
MAX_LINES = 600

# Lowest first. A package may import packages of its own layer or below (never one that imports it back).
# docs/architecture.md draws this table and says what each package holds.
LAYERS = [
    ["version", "utils", "config", "accelerator"],  # foundations: no torch.distributed, no training state
    ["comm", "module_inject", "monitor", "ops", "optimizers"],  # process groups; TP layers; kernels
    ["core"],  # the training parts every feature builds on
    ["checkpoint", "checkpointing"],  # checkpoint files and layouts; activation checkpointing
    # one package per feature
    ["zero", "moe", "pipe", "sequence", "compression", "profiling", "data_pipeline", "fairscale"],
    ["runtime", "inference"],  # the engines that compose the features
    ["api", "mii", "launcher", "tools", "compat", "autotuning"],  # entry points; DeepSpeed's paths
]
LAYER_OF = {package: rank for rank, packages in enumerate(LAYERS) for package in packages}


def _modules() -> dict[str, Path]:
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skipped = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.If)
            and getattr(node.test, "id", getattr(node.test, "attr", "")) == "TYPE_CHECKING"
        ):
            skipped.update(id(inner) for inner in ast.walk(node))
    return skipped


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports (resolved to the longest existing module name)."""

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = collections.defaultdict(set)
    for module, path in modules.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skipped = _type_checking_nodes(tree)
        package_parts = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package_parts[: len(package_parts) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                if target.split(".")[0] == PACKAGE.name:
                    found = resolve(target)
                    if found and found not in (module, PACKAGE.name):
                        edges[module].add(found)
    return edges


def _top(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in list(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def _package_edges(edges) -> dict[tuple[str, str], list[str]]:
    between = collections.defaultdict(list)
    for module, targets in edges.items():
        for target in targets:
            a, b = _top(module), _top(target)
            if a != b and "<root>" not in (a, b):
                between[(a, b)].append(f"{module} -> {target}")
    return between


def test_no_import_cycle_between_modules():
    assert _cycles(_imports(_modules())) == []


def test_no_two_packages_import_each_other():
    between = _package_edges(_imports(_modules()))
    pairs = {
        tuple(sorted(pair)): between[pair] + between[pair[::-1]] for pair in between if pair[::-1] in between
    }
    assert pairs == {}


def test_every_package_has_a_layer_and_imports_only_down_or_sideways():
    modules = _modules()
    packages = {_top(m) for m in modules} - {"<root>"}
    assert packages - set(LAYER_OF) == set(), (
        "a new package: give it a layer here and in docs/architecture.md"
    )
    upward = [
        line
        for (a, b), lines in _package_edges(_imports(modules)).items()
        if LAYER_OF[a] < LAYER_OF[b]
        for line in lines
    ]
    assert upward == []


def test_the_library_never_imports_deepspeed():
    offenders = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            offenders += [module for name in names if name.split(".")[0] == "deepspeed"]
    assert offenders == []


def test_no_module_over_the_line_limit():
    long = {
        m: n
        for m, p in _modules().items()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}


def test_the_checks_find_what_they_look_for(tmp_path, monkeypatch):
    """The checks above pass only if they can fail: a planted cycle, pair, upward import and long module."""
    fake = tmp_path / "shardspeed"
    for name, text in {
        "__init__.py": "",
        "core/__init__.py": "",
        "core/a.py": "from shardspeed.core import b\n",
        "core/b.py": "def f():\n    from shardspeed.core.a import x\n",
        "zero/__init__.py": "from shardspeed.core import a\n",
        "runtime/__init__.py": "import shardspeed.zero\n" + "x = 1\n" * (MAX_LINES + 1),
        "utils/__init__.py": "from shardspeed.runtime import x\n",
        "config/__init__.py": "from shardspeed import utils\n",
    }.items():
        (fake / name).parent.mkdir(parents=True, exist_ok=True)
        (fake / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
    edges = _imports(_modules())
    assert _cycles(edges) == [["shardspeed.core.a", "shardspeed.core.b"]]
    between = _package_edges(edges)
    assert ("utils", "runtime") in between and ("runtime", "zero") in between
    assert [pair for pair in between if LAYER_OF[pair[0]] < LAYER_OF[pair[1]]] == [("utils", "runtime")]
    with pytest.raises(AssertionError):
        test_no_module_over_the_line_limit()
