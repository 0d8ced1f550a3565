"""No module of the package reaches into another's private names, and a job's state lives in one object.

A leading underscore means "this module's own": a name another module needs is public (renamed, or given a public
accessor). The test reads every module of hybridpipe/ with ast and fails, naming file:line, on

* ``from <package module> import _name``;
* ``something._name`` (read, write or delete) and ``getattr / hasattr / setattr / delattr(x, "_name")`` where
  ``_name`` is defined in another module of the package (as a function, class, variable, argument or attribute)
  and not in this one: names only torch or the standard library define (``torch._foreach_copy_``, ``t._version``,
  ``sys._getframe``) are theirs to keep stable, not the package's;

* ``x._name = ...`` / ``del x._name`` and ``setattr / delattr(x, "_name", ...)`` on an object other than ``self``
  or ``cls``: private state written onto another object (a ``Parameter``, a module, an optimizer) is a contract
  nobody can see; give the owner a constructor argument or a public method instead;

and, separately, on module-level mutable state: a ``global`` statement, a module-level variable with a
lower-case name (constants are UPPER_CASE, types CapWords), or an UPPER_CASE module-level container (a dict,
list or set) that the module changes (``X[k] = v``, ``del X[k]``, ``X.append(...)``...: a constant in name
only), outside the running job (:mod:`hybridpipe.running`, which holds the one object hp.init makes and
hp.shutdown drops).

Each allowed exception below says why; keep both lists short.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hybridpipe"

#: (importing module, private name) -> why it may import it.
ALLOWED_IMPORTS: dict[tuple[str, str], str] = {
    ("_ext", "_C"): "the compiled extension; _ext is its one importer (tests/test_structure.py)",
    ("*", "_ext"): "a package-private module (the checked loading of _C), private to the package, not to a module",
    ("*", "_trace"): "a package-private module (the timeline's recorder; hybridpipe.timeline is the public one)",
}

#: (module, private attribute) -> why it may use a private name another module of the package defines.
ALLOWED_ATTRIBUTES: dict[tuple[str, str], str] = {
    # DistributedOptimizer's class is _DistributedOptimizerMixin (optimizer.py) with, for zero=, ZeroMixin
    # (zero.py) before it: two halves of one class, sharing its _hp_ attributes (prefixed so that they never
    # collide with the wrapped optimizer's own)
    ("data_parallel.zero", "_hp_*"): "ZeroMixin is layered over optimizer.py's mixin: one class, two modules",
    ("data_parallel.optimizer", "_hp_zero_setup"): "the same class: DistributedOptimizer(zero=) sets ZeRO up",
    # torch.nn.Module's own dictionaries: registering a tensor without its __setattr__ (split.py moves
    # parameters and buffers between modules it built itself); other modules of the package name a variable so
    ("pipeline.split", "_parameters"): "torch.nn.Module's parameter dict (torch's name, not the package's)",
    ("pipeline.split", "_buffers"): "torch.nn.Module's buffer dict (torch's name, not the package's)",
}

#: (module, variable) -> why it is module-level mutable state outside the job object.
ALLOWED_STATE: dict[tuple[str, str], str] = {
    ("running", "_current"): "the running job itself (hp.init sets it, hp.shutdown clears it)",
    ("pipeline.skip", "_state"): "a thread's current SkipContext, a dynamic scope like torch.no_grad's (hp.stash "
                                 "and hp.pop work without hp.init, in one process)",
    ("comm.process_sets", "global_process_set"): "Horovod's hp.global_process_set, a public object of the API "
                                                 "(id 0; each hp.init sets its ranks)",
    ("running", "_outside_job"): "p2p's receives posted outside a job (hybridpipe.comm.p2p works without hp.init); "
                                 "inside one they are the job's",
    ("testing.emulated_hosts", "_instances"): "the test harness's count of emulated host sets (network "
                                              "namespace names must not repeat in one process)",
    ("pipeline.split", "_DISPATCHING"): "a cache of the subclasses split= makes, one per module class: the same in "
                                        "every job and every thread (a class must not be made twice)",
}

#: (module, private attribute) -> why it may write it on an object other than self or cls.
ALLOWED_FOREIGN_WRITES: dict[tuple[str, str], str] = {
    ("testing.emulated_hosts", "_undo"): "EmulatedHosts.load, a classmethod, fills in the instance it just made",
}

MUTATING_METHODS = frozenset(("append", "extend", "insert", "update", "add", "pop", "popitem", "clear",
                              "setdefault", "remove", "discard"))
CONTAINER_CALLS = frozenset(("dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter",
                             "WeakKeyDictionary", "WeakValueDictionary", "WeakSet"))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, tuple[Path, ast.Module]]:
    return {_module_name(path): (path, ast.parse(path.read_text(), str(path)))
            for path in sorted(PACKAGE.rglob("*.py"))}


def _defined(tree: ast.Module) -> set[str]:
    """The private names a module defines: functions, classes, variables, arguments, attributes it assigns,
    names it binds on import."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.alias) and node.asname:
            names.add(node.asname)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
            names.add(str(node.args[1].value))
    return {name for name in names if _private(name)}


def _package_import(node: ast.ImportFrom) -> bool:
    return node.level > 0 or (node.module or "").split(".")[0] == "hybridpipe"


def _attribute_uses(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of every ``x._name`` and ``getattr(x, "_name")``-like use of a private name."""
    uses = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            uses.append((node.lineno, node.attr))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str) \
                and _private(node.args[1].value):
            uses.append((node.lineno, node.args[1].value))
    return uses


def _allowed(table: dict, module: str, name: str) -> bool:
    return any((m in (module, "*")) and (n == name or (n.endswith("*") and name.startswith(n[:-1])))
               for m, n in table)


def _index(modules: dict[str, tuple[Path, ast.Module]]) -> dict[str, tuple[Path, set[str], list, list]]:
    """Per module: its path, the private names it defines, its private package imports, its private attribute
    uses (read once, checked against each allow-list)."""
    index = {}
    for module, (path, tree) in modules.items():
        imports = [(node.lineno, f"{'.' * node.level}{node.module or ''}", alias.name) for node in ast.walk(tree)
                   if isinstance(node, ast.ImportFrom) and _package_import(node)
                   for alias in node.names if _private(alias.name)]
        index[module] = (path, _defined(tree), imports, sorted(_attribute_uses(tree)))
    return index


def private_reaches(modules: dict[str, tuple[Path, ast.Module]], index: dict | None = None) -> list[str]:
    """Every use of another module's private name, as ``file:line: what``."""
    index = index or _index(modules)
    anywhere = set().union(*(defined for _, defined, _, _ in index.values()))
    found = []
    for module, (path, defined, imports, uses) in index.items():
        where = path.relative_to(PACKAGE.parent)
        found += [f"{where}:{line}: from {source} import {name}" for line, source, name in imports
                  if not _allowed(ALLOWED_IMPORTS, module, name)]
        for line, name in uses:
            if name in anywhere and name not in defined and not _allowed(ALLOWED_ATTRIBUTES, module, name):
                owners = sorted(m for m, (_, names, _, _) in index.items() if name in names)
                found.append(f"{where}:{line}: .{name} (defined in {', '.join(owners)})")
    return found


def foreign_writes(modules: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    """Private attributes written on (or deleted from) an object other than ``self`` / ``cls``."""
    found = []
    for module, (path, tree) in modules.items():
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, (ast.Store, ast.Del)):
                owner, name = node.value, node.attr
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                    and node.func.id in ("setattr", "delattr") and len(node.args) > 1 \
                    and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
                owner, name = node.args[0], node.args[1].value
            else:
                continue
            if _private(name) and not (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) \
                    and not _allowed(ALLOWED_FOREIGN_WRITES, module, name):
                found.append(f"{where}:{node.lineno}: {ast.unparse(owner)}.{name} written")
    return found


def _mutable_constants(tree: ast.Module) -> dict[str, int]:
    """UPPER_CASE module-level names bound to a container the module then changes: name -> line of the change."""
    containers = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
        value = getattr(node, "value", None)
        made = isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)) or (
            isinstance(value, ast.Call) and getattr(value.func, "id", getattr(value.func, "attr", "")) in CONTAINER_CALLS)
        containers |= {t.id for t in targets if made and isinstance(t, ast.Name) and t.id.lstrip("_").isupper()}
    changed: dict[str, int] = {}
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, (ast.Assign, ast.Delete)) else \
            [node.target] if isinstance(node, ast.AugAssign) else []
        for target in targets:
            if isinstance(target, ast.Subscript) and getattr(target.value, "id", None) in containers:
                changed.setdefault(target.value.id, node.lineno)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr in MUTATING_METHODS and getattr(node.func.value, "id", None) in containers:
            changed.setdefault(node.func.value.id, node.lineno)
    return changed


def module_state(modules: dict[str, tuple[Path, ast.Module]]) -> list[str]:
    """Module-level mutable state: ``global`` statements, lower-case module-level variables, and UPPER_CASE
    containers the module changes."""
    found = []
    for module, (path, tree) in modules.items():
        where = path.relative_to(PACKAGE.parent)
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                found += [f"{where}:{node.lineno}: global {name}" for name in node.names
                          if not _allowed(ALLOWED_STATE, module, name)]
        found += [f"{where}:{line}: {name} changed (a module-level container)"
                  for name, line in _mutable_constants(tree).items() if not _allowed(ALLOWED_STATE, module, name)]
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, ast.AnnAssign) and node.value is not None else []
            for target in targets:
                for name in (n.id for n in ast.walk(target) if isinstance(n, ast.Name)):
                    bare = name.lstrip("_")
                    if name.startswith("__") or not bare or not bare[0].islower() or bare.isupper():
                        continue  # dunders, UPPER_CASE constants, CapWords types
                    if not _allowed(ALLOWED_STATE, module, name):
                        found.append(f"{where}:{node.lineno}: {name} = ...")
    return found


def test_no_module_reaches_into_another_modules_private_names():
    found = private_reaches(_modules())
    assert not found, "private names used outside the module that defines them (make them public, or give the " \
                      "owner a public accessor):\n" + "\n".join(found)


def test_no_module_level_mutable_state_outside_the_running_job():
    found = module_state(_modules())
    assert not found, "module-level mutable state (put it on the running job, hybridpipe/comm/context.py's " \
                      "CommContext, which hp.shutdown drops):\n" + "\n".join(found)


def test_no_module_writes_private_attributes_on_other_objects():
    found = foreign_writes(_modules())
    assert not found, "private attributes written on another object (pass it to the owner's constructor or give " \
                      "the owner a public method):\n" + "\n".join(found)


def test_the_new_checks_find_a_planted_write_and_a_changed_constant():
    planted = ast.parse("CACHE = {}\nLIMITS = (1, 2)\ndef f(p, self):\n    p._owner = 1\n    setattr(p, '_chunk', 2)\n"
                        "    self._mine = 3\n    CACHE[p] = 1\n    print(LIMITS[0])\n")
    modules = {"planted": (PACKAGE / "planted.py", planted)}
    assert foreign_writes(modules) == ["hybridpipe/planted.py:4: p._owner written",
                                       "hybridpipe/planted.py:5: p._chunk written"]
    assert module_state(modules) == ["hybridpipe/planted.py:7: CACHE changed (a module-level container)"]


def test_the_checks_find_what_they_look_for():
    """A planted reach and a planted global are found, with file and line (so the two tests above can fail)."""
    owner = ast.parse("def _helper():\n    pass\n_cache = {}\n")
    user = ast.parse("from .owner import _helper\nimport owner\nowner._cache.clear()\nprint(getattr(owner, '_cache'))\n"
                     "def f():\n    global counter\n")
    modules = {"owner": (PACKAGE / "owner.py", owner), "user": (PACKAGE / "user.py", user)}
    reaches = private_reaches(modules)
    assert reaches == ["hybridpipe/user.py:1: from .owner import _helper", "hybridpipe/user.py:3: ._cache (defined in owner)",
                       "hybridpipe/user.py:4: ._cache (defined in owner)"], reaches
    assert module_state(modules) == ["hybridpipe/owner.py:3: _cache = ...", "hybridpipe/user.py:6: global counter"]


def test_every_allowed_exception_is_still_used():
    """An exception nothing needs any more goes (the lists only shrink)."""
    modules = _modules()
    index = _index(modules)
    reaches = lambda modules: private_reaches(modules, index)  # noqa: E731
    saved = dict(ALLOWED_IMPORTS), dict(ALLOWED_ATTRIBUTES), dict(ALLOWED_STATE), dict(ALLOWED_FOREIGN_WRITES)
    unused = []
    try:
        for table, check in ((ALLOWED_IMPORTS, reaches), (ALLOWED_ATTRIBUTES, reaches), (ALLOWED_STATE, module_state),
                             (ALLOWED_FOREIGN_WRITES, foreign_writes)):
            for key in list(table):
                why = table.pop(key)
                if not check(modules):
                    unused.append(key)
                table[key] = why
    finally:
        for table, kept in zip((ALLOWED_IMPORTS, ALLOWED_ATTRIBUTES, ALLOWED_STATE, ALLOWED_FOREIGN_WRITES), saved):
            table.clear()
            table.update(kept)
    assert not unused, f"allowed exceptions nothing uses any more (remove them): {unused}"


def test_the_job_object_has_no_untyped_fields_of_upper_layers():
    """CommContext keeps what the communication layer owns, each field typed; a layer above keeps its per-job
    state in a slot of its own class (``job.slot(Kind, make)``), never in an ``Any`` field of the job."""
    tree = ast.parse((PACKAGE / "comm" / "context.py").read_text())
    [init] = [node for cls in tree.body if isinstance(cls, ast.ClassDef) and cls.name == "CommContext"
              for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__"]
    untyped = [f"self.{node.target.attr}" for node in ast.walk(init) if isinstance(node, ast.AnnAssign)
               and isinstance(node.target, ast.Attribute) and ast.unparse(node.annotation) == "Any"]
    assert not untyped, f"CommContext fields typed Any: {untyped} (type them, or make them a slot of their layer)"
    assert {"step_guard", "autotuner"}.isdisjoint(node.target.attr for node in ast.walk(init)
                                                  if isinstance(node, (ast.AnnAssign,)) and
                                                  isinstance(node.target, ast.Attribute))
