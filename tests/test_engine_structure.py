"""The C++ engine's structure: collaborating classes by role, each in its own files, with their lock rules
in their types, and ``module.cpp`` holding bindings only.

* Every role class is declared in its own header under ``csrc/`` (and no other file declares it), with its own
  ``.cpp`` beside it defining its members (:data:`ROLES`).
* The engine's shared mutable state lives only in ``Guarded<>`` / ``CommThreadOnly<>`` members (csrc/engine_guard.h):
  no engine file but engine_guard.h names a ``std::mutex``, ``std::timed_mutex`` or condition variable (a
  ``std::unique_lock<std::timed_mutex>`` holding another class's lock is allowed), and every data member of the
  engine's classes is of a kind that says its rule (:func:`member_violations`).
* ``module.cpp`` defines no function but the ``PYBIND11_MODULE`` block, and that block has no lambda and no
  control flow: each binding names a function of direct_ops / transfer_ops / engine_py / zero_ops.cpp.

The parsing is textual, on code with comments and strings blanked (tests/test_code_limits.py's scanner).
"""

from __future__ import annotations

import re
from pathlib import Path

from test_code_limits import blank_code, scan

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"

#: role class -> the stem of its files (csrc/<stem>.h declares it, csrc/<stem>.cpp defines its members; None: a
#: header-only aggregate).
ROLES = {
    "Engine": ("engine", True),
    "TensorQueue": ("engine_queue", True),
    "Controller": ("engine_controller", True),
    "ResponseCache": ("engine_cache", True),
    "StallInspector": ("engine_stall", True),
    "JoinTracker": ("engine_join", True),
    "Watchdog": ("engine_watchdog", True),
    "BucketExecutor": ("engine_buckets", True),
    "EventLog": ("engine_events", True),
    "EngineOptions": ("engine_options", False),
}
#: classes whose data members must each say their lock rule (ResponseCache is held whole in a CommThreadOnly).
CHECKED_CLASSES = ("Engine", "TensorQueue", "Controller", "StallInspector", "JoinTracker", "Watchdog",
                   "BucketExecutor", "EventLog", "Group")
#: a data member's type (or declarator) that says its rule: immutable (const, or a const pointer), a reference to a
#: collaborator, behind a lock, the communication thread's own, self-synchronised, or one of the role classes (with
#: rules of its own).
RULE_TYPES = re.compile(r"^(?:const\b|Guarded<|CommThreadOnly<|std::atomic<|Signal\b|CommThread\b|"
                        + "|".join(name + r"\b" for name in ROLES if name != "EngineOptions") + ")")
#: declared outside the rule types, but reachable only with the queue's lock (Group::queue takes TensorQueue::Locked)
LOCK_TOKEN_MEMBERS = {"Group": {"GroupQueue queue_"}}
SYNC_PRIMITIVE = re.compile(r"\bstd::(?:mutex|timed_mutex|recursive_mutex|recursive_timed_mutex|shared_mutex|"
                            r"condition_variable(?:_any)?)\b(?!\s*>)")
LAMBDA = re.compile(r"\[[^\[\]]*\]\s*(?:\(|\{|mutable\b|->)")
CONTROL = re.compile(r"\b(?:for|if|while|switch|try|catch|do|goto)\b")


def engine_files(root: Path = CSRC) -> list[Path]:
    return sorted(p for p in root.glob("engine*") if p.suffix in (".h", ".cpp"))


def declarations(name: str, root: Path = CSRC) -> list[str]:
    """Files under `root` that define the class or struct `name` (a body, not a forward declaration)."""
    pattern = re.compile(r"\b(?:class|struct)\s+" + re.escape(name) + r"\b[^;{]*\{")
    return sorted(p.name for p in root.glob("*") if p.suffix in (".h", ".cpp")
                  and pattern.search(blank_code(p.read_text())))


def class_body(code: str, name: str) -> str | None:
    """The body of class/struct `name` in blanked `code`, with nested braces (inline functions, nested types)
    emptied."""
    match = re.search(r"\b(?:class|struct)\s+" + re.escape(name) + r"\b[^;{]*\{", code)
    if not match:
        return None
    depth, out, function_body = 1, [], False
    for char in code[match.end():]:
        if char == "{":
            if depth == 1:  # an inline function's body (after its parameters and qualifiers), or an initializer
                function_body = re.search(r"\)\s*(?:const|noexcept|override|final|\s)*$", "".join(out[-200:])) is not None
            depth += 1
            continue
        if char == "}":
            depth -= 1
            if depth == 0:
                break
            if depth == 1 and function_body:
                out.append(";")  # the body ends the function's declaration
            continue
        if depth == 1:
            out.append(char)
    return "".join(out)


def data_members(body: str) -> list[str]:
    """The data member declarations of a class body (as `class_body` gives it), one string each."""
    members = []
    for statement in body.split(";"):
        statement = re.sub(r"\b(?:public|private|protected)\s*:", " ", statement)
        statement = " ".join(statement.split())
        if not statement or "(" in statement or "operator" in statement:
            continue  # functions (and their declarations), nothing
        if re.match(r"(?:using|typedef|friend|template|static|enum|struct|class|union)\b", statement):
            continue
        members.append(statement.split("=")[0].strip())
    return members


def member_violations(code: str, name: str) -> list[str]:
    """`name`'s data members whose type does not say their lock rule."""
    body = class_body(code, name)
    assert body is not None, f"class {name} not found"
    allowed = LOCK_TOKEN_MEMBERS.get(name, set())
    return [m for m in data_members(body)
            if not (RULE_TYPES.match(m) or "&" in m.split()[0] or re.search(r"\*\s*const\b", m) or m in allowed)]


def sync_primitives(path: Path) -> list[str]:
    """`path:line: text` of every bare mutex or condition variable named in `path`'s code."""
    code = blank_code(path.read_text())
    lines = code.splitlines()
    return [f"{path.name}:{n}: {lines[n - 1].strip()}" for n in range(1, len(lines) + 1)
            if SYNC_PRIMITIVE.search(lines[n - 1])]


def module_logic(path: Path) -> list[str]:
    """What in a bindings file is more than registrations: functions besides PYBIND11_MODULE, lambdas, control flow."""
    code = blank_code(path.read_text())
    found = [f"function {f.name} (line {f.first_line})" for f in scan(path) if f.name != "PYBIND11_MODULE"]
    for number, line in enumerate(code.splitlines(), 1):
        if LAMBDA.search(line):
            found.append(f"a lambda at line {number}: {line.strip()}")
        if CONTROL.search(line):
            found.append(f"control flow at line {number}: {line.strip()}")
    return found


def test_each_role_class_has_its_own_files():
    problems = []
    for name, (stem, has_source) in ROLES.items():
        header = CSRC / f"{stem}.h"
        where = declarations(name)
        if where != [header.name]:
            problems.append(f"{name}: declared in {where or 'no file'}, expected only {header.name}")
        source = CSRC / f"{stem}.cpp"
        if has_source and not (source.exists() and re.search(r"\b" + name + r"::\w+\s*\(",
                                                             blank_code(source.read_text()))):
            problems.append(f"{name}: no member defined in {source.name}")
    # one header per role: no header declares two of them
    for header in {stem for stem, _ in ROLES.values()}:
        roles = [n for n, (stem, _) in ROLES.items() if stem == header]
        assert len(roles) == 1, f"{header}.h holds several roles: {roles}"
    assert not problems, "\n".join(problems)


def test_engine_state_sits_in_guard_types():
    primitives = [hit for path in engine_files() if path.name != "engine_guard.h" for hit in sync_primitives(path)]
    assert not primitives, ("a mutex or condition variable outside csrc/engine_guard.h (hold state in Guarded<> or "
                            "CommThreadOnly<>, wait on a Signal):\n" + "\n".join(primitives))
    code = "\n".join(blank_code(p.read_text()) for p in engine_files() if p.suffix == ".h")
    violations = {name: member_violations(code, name) for name in CHECKED_CLASSES}
    violations = {name: found for name, found in violations.items() if found}
    assert not violations, f"data members whose type does not say their lock rule: {violations}"
    group = class_body(code, "Group")
    assert re.search(r"GroupQueue\s*&\s*queue\s*\(\s*const\s+TensorQueue::Locked\s*&", code), \
        "Group::queue() must ask for the queue's lock"
    assert "Guarded<QueueState>" in class_body(code, "TensorQueue") and group is not None


def test_module_cpp_holds_bindings_only():
    logic = module_logic(CSRC / "module.cpp")
    assert not logic, "module.cpp must only register bindings (move the work to a named function):\n" + "\n".join(logic)
    module = blank_code((CSRC / "module.cpp").read_text())
    for function, home in (("submit_reducescatter", "zero_ops.cpp"), ("submit_allgather", "zero_ops.cpp"),
                           ("engine_wait", "engine_py.cpp"), ("allreduce_direct", "direct_ops.cpp"),
                           ("isend_py", "transfer_ops.cpp")):
        assert f"&{function}" in module, f"module.cpp does not bind {function}"
        assert re.search(r"\b" + function + r"\s*\([^;]*\)\s*\{", blank_code((CSRC / home).read_text())), \
            f"{function} is not defined in {home}"


def test_the_checks_catch_planted_violations(tmp_path):
    engine = tmp_path / "engine_planted.h"
    engine.write_text("#include <mutex>\nclass Engine {\n public:\n  void f() { std::lock_guard<std::mutex> l(m_); }\n"
                      " private:\n  std::mutex m_;  // a comment: std::mutex\n  int counter_ = 0;\n"
                      "  const int fixed_ = 1;\n  Guarded<int> guarded_;\n  TensorQueue& queue_;\n"
                      "  std::unique_lock<std::timed_mutex>* held_ = nullptr;\n};\n")
    assert [hit.split(": ", 1)[1] for hit in sync_primitives(engine)] == ["std::mutex m_;"]
    assert member_violations(blank_code(engine.read_text()), "Engine") == ["std::mutex m_", "int counter_",
                                                                            "std::unique_lock<std::timed_mutex>* held_"]
    module = tmp_path / "module.cpp"
    module.write_text("int helper(int x) { return x; }\nPYBIND11_MODULE(_C, m) {\n  m.def(\"a\", &helper);\n"
                      "  m.def(\"b\", [](int x) {\n    if (x) return 1;\n    return 0;\n  });\n}\n")
    found = module_logic(module)
    assert found[0].startswith("function helper") and any("lambda" in f for f in found) and \
        any("control flow" in f for f in found)
