"""The package's structure: imports go one way, down the layers below, and the package imports light.

Every module's imports are read with ``ast``, at module level and inside functions alike (a function-level
import that goes up a layer is a cycle hidden from Python's import machinery, not a cure for one), plus the
names the package's ``__getattr__`` imports by string (``_LAZY_MODULES``). Each import must go to a module of
the same layer or a lower one, and the graph of all of them must have no cycle. A new module must be placed
in a layer (the test names it otherwise).
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "hybridpipe"

#: The layers, lowest first: a module may import modules of its own layer or of lower ones. Names are
#: relative to the package ("" is hybridpipe/__init__.py, the public facade); "*" matches within a package.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors", ("errors",)),
    ("config and the option registries", ("config", "registry")),
    ("the running job", ("running",)),
    # the contract between what runs a model's forwards and backwards and data parallelism: the pipeline
    # drives it, DistributedOptimizer implements it, the job keeps its drivers
    ("gradient sync contract", ("gradient_sync",)),
    ("extension and trace", ("_ext", "_trace")),
    # comm, lowest first: what the context object is built from, the context, then what runs on it
    ("comm: foundations", ("comm.departures", "comm.ring")),
    ("comm: device", ("comm.device",)),
    ("comm: buffers", ("comm.buffers",)),
    ("comm: process sets", ("comm.process_sets",)),
    ("comm: context", ("comm.context",)),
    ("comm: staging, adasum", ("comm.staging", "comm.adasum")),
    ("comm: reduction", ("comm.reduction",)),
    ("comm: engine", ("comm.engine",)),
    ("comm: over the engine", ("comm.p2p", "comm.agree")),
    ("comm package", ("comm",)),
    # the collectives, one module per family: the shared checks and ops, then allreduce, which the others build on
    ("collectives: common", ("collectives", "collectives.common")),
    ("collectives: allreduce", ("collectives.allreduce",)),
    ("collectives: over allreduce", ("collectives.broadcast", "collectives.allgather", "collectives.alltoall",
                                     "collectives.barrier")),
    ("collectives: over allgather", ("collectives.reducescatter", "collectives.sparse")),
    ("comm: autotune", ("comm.autotune",)),
    ("runtime", ("runtime", "rng_state", "capabilities", "timeline")),
    ("checkpoint", ("checkpoint", "pretrained")),
    # data_parallel below the pipeline: the loss scaler serves the pipeline; the optimizer meets the pipeline only
    # through gradient_sync (registered as the job's drivers)
    ("data_parallel", ("data_parallel", "data_parallel.*")),
    ("pipeline", ("pipeline", "pipeline.*")),
    ("plan", ("plan", "plan.*")),
    ("public facade", ("",)),
    ("launch, testing, command lines", ("launch", "__main__", "plan.__main__", "testing", "testing.*")),
]

#: (importer, imported) -> why the import may go up a layer or close a cycle. Keep it short; shrink it.
ALLOWED: dict[tuple[str, str], str] = {
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def layer_of(name: str) -> int:
    """The index of the last layer whose patterns match ``name`` (so "plan.__main__" beats "plan.*")."""
    found = [index for index, (_, patterns) in enumerate(LAYERS)
             if any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)]
    if not found:
        raise KeyError(name)
    return found[-1]


def _resolve(importer: str, is_package: bool, level: int, module: str | None, names: list[str],
             known: set[str]) -> set[str]:
    """The package modules an import statement imports (``from x import y``: ``x.y`` when that is a module)."""
    if level:
        base = importer.split(".") if importer else []
        if not is_package:
            base = base[:-1]
        base = base[:len(base) - (level - 1)]
        target = ".".join(base + ([module] if module else []))
    else:
        if module is None or not (module == "hybridpipe" or module.startswith("hybridpipe.")):
            return set()
        target = module[len("hybridpipe."):] if module != "hybridpipe" else ""
    if not names:  # import x.y / import_module("x.y")
        return {target} if target in known else set()
    found = set()
    for name in names:
        sub = f"{target}.{name}" if target else name
        if sub in known:
            found.add(sub)
        elif any(PACKAGE.joinpath(*sub.split(".")[:-1]).glob(f"{sub.split('.')[-1]}.*.so")):
            continue  # the compiled extension (hybridpipe._C, imported by _ext only)
        elif target in known:
            found.add(target)
    return found


def imports_in(name: str, source: str, is_package: bool, known: set[str]) -> list[tuple[str, int, bool]]:
    """(imported, line, inside a function) for every import of a package module in module ``name``'s source:
    ``import``, ``from ... import`` (relative too) and ``importlib.import_module("<literal>", ...)``."""
    tree = ast.parse(source)
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function.update(id(inner) for inner in ast.walk(node) if inner is not node)
    found: list[tuple[str, int, bool]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            targets = _resolve(name, is_package, node.level, node.module, [a.name for a in node.names], known)
        elif isinstance(node, ast.Import):
            targets = set().union(*(_resolve(name, is_package, 0, alias.name, [], known) for alias in node.names))
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              == "import_module" and node.args and isinstance(node.args[0], ast.Constant)):
            spec = node.args[0].value
            level = len(spec) - len(spec.lstrip("."))
            targets = _resolve(name, is_package, level, spec.lstrip(".") or None, [], known)
        else:
            continue
        found += [(target, node.lineno, id(node) in in_function) for target in targets if target != name]
    return found


@functools.lru_cache(maxsize=1)
def imports() -> list[tuple[str, str, int, bool]]:
    """(importer, imported, line, inside a function) for every import of a package module by another (read once
    per test session: the files do not change during it)."""
    known = set(modules())
    found = [(name, *edge) for name, path in modules().items()
             for edge in imports_in(name, path.read_text(), path.name == "__init__.py", known)]
    # the facade's names imported on first use (hybridpipe/__init__.py's __getattr__)
    import hybridpipe

    found += [("", module.lstrip("."), 0, True) for module in hybridpipe._LAZY_MODULES]
    return found


def _describe(importer: str, imported: str, line: int, local: bool) -> str:
    where = f"hybridpipe/{importer.replace('.', '/') or '__init__'}.py:{line}"
    return (f"{where} imports {imported or 'hybridpipe'} ({LAYERS[layer_of(imported)][0]}) from layer "
            f"{LAYERS[layer_of(importer)][0]!r}{' inside a function' if local else ''}")


def test_every_module_has_a_layer():
    unplaced = [name or "hybridpipe" for name in modules() if not any(
        fnmatch.fnmatchcase(name, pattern) for _, patterns in LAYERS for pattern in patterns)]
    assert not unplaced, f"put these modules in a layer of tests/test_structure.py's LAYERS: {unplaced}"


def test_imports_go_down_the_layers():
    upward = sorted({_describe(*edge) for edge in imports() if layer_of(edge[1]) > layer_of(edge[0])
                     and edge[:2] not in ALLOWED})
    assert not upward, "imports that go up a layer (move the code to the layer that owns it, pass a " \
        "callable down, or register a hook from above):\n" + "\n".join(upward)


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each sorted."""
    graph: dict[str, set[str]] = {}
    for source, target in edges:
        graph.setdefault(source, set()).add(target)
        graph.setdefault(target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_imports_are_read_in_every_form():
    known = {"", "_trace", "comm", "comm.engine", "comm.reduction", "comm.context", "comm.device"}
    source = """
from . import engine
from .reduction import Sum
from .. import _trace as timeline
import hybridpipe as hp, numpy
import hybridpipe.comm.device
def later():
    from .context import current
    return lambda: __import__("json")
"""
    assert sorted(imports_in("comm.p2p", source, False, known)) == [
        ("", 5, False), ("_trace", 4, False), ("comm.context", 8, True), ("comm.device", 6, False),
        ("comm.engine", 2, False), ("comm.reduction", 3, False)]
    lazy = 'def __getattr__(name):\n    return importlib.import_module(".device", __name__)\n'
    assert imports_in("comm", lazy, True, known) == [("comm.device", 2, True)]
    found = {edge[:2] for edge in imports()}
    assert ("", "plan.auto") in found  # the facade's lazy table
    assert ("", "data_parallel.elastic") in found  # hp.elastic, by import_module
    assert not any(imported == "_C" for _, imported in found)  # the compiled extension is no module here


def test_cycle_finder_finds_a_hidden_cycle():
    assert cycles({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == [["a", "b", "c"]]
    assert cycles({("a", "b"), ("b", "c")}) == []


def test_no_import_cycles():
    edges = [edge for edge in imports() if edge[:2] not in ALLOWED]
    found = cycles({edge[:2] for edge in edges})
    report = []
    for component in found:
        inside = [edge for edge in edges if edge[0] in component and edge[1] in component]
        closing = [edge for edge in inside if layer_of(edge[1]) > layer_of(edge[0])] or inside  # the upward ones
        report.append(" <-> ".join(name or "hybridpipe" for name in component) + ", closed by: " +
                      "; ".join(_describe(*edge) for edge in closing))
    assert not found, "import cycles (module-level and function-level imports together):\n" + "\n".join(report)


def test_the_allow_list_holds_only_imports_that_exist():
    present = {edge[:2] for edge in imports()}
    stale = sorted(set(ALLOWED) - present)
    assert not stale, f"remove these from ALLOWED in tests/test_structure.py (no longer imported): {stale}"


@pytest.mark.parametrize("module", ["hybridpipe", "hybridpipe.launch", "hybridpipe.comm"])
def test_the_light_imports_load_no_torch(module):
    """The launcher and `python -m hybridpipe` start without torch (0.3 s instead of 3.8 s); so does the comm
    package until a collective runs."""
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'hybridpipe._C') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"import {module} loaded {result.stdout.strip()}"


def test_every_public_name_resolves():
    import hybridpipe as hp

    assert len(hp.__all__) == len(set(hp.__all__))
    lazy = set(hp._LAZY)
    assert lazy <= set(hp.__all__), f"lazy names missing from __all__: {sorted(lazy - set(hp.__all__))}"
    missing = []
    for name in hp.__all__:
        try:
            getattr(hp, name)
        except AttributeError:
            missing.append(name)
    assert not missing
    assert callable(hp.elastic.run) and isinstance(hp.elastic.TorchState, type)  # hvd.elastic.run / TorchState


@pytest.mark.parametrize("name", ["comm.context", "pipeline.model", "data_parallel.elastic"])
def test_a_module_imports_first(name):
    """A fresh interpreter imports the module before any other of the package's (but the facade's light three)."""
    result = subprocess.run([sys.executable, "-c", f"import hybridpipe.{name}"], capture_output=True, text=True,
                            cwd=ROOT, timeout=120)
    assert result.returncode == 0, result.stderr


def test_the_repository_needs_nothing_beside_it():
    """No tracked file reads or points at the shared workspace beside a checkout: PipeDream's profiles live in
    bench/data/pipedream/, the benchmark guard is bench/guard.py."""
    files = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True).stdout.split()
    needle = "../" + "shared"  # (spelled apart so that this file does not find itself)
    found = [name for name in files if (ROOT / name).is_file() and
             needle in (ROOT / name).read_text(errors="replace")]
    assert not found, f"files that need {needle}: {found}"
    assert (ROOT / "bench" / "data" / "pipedream" / "vgg16.json").is_file()
