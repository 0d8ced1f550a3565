"""Code-size limits: no function in csrc/ is longer than :data:`MAX_FUNCTION_LINES` lines, except the
pybind11 module definition; no Python function of the package (hybridpipe/, not tests or bench) is longer than
:data:`MAX_PYTHON_FUNCTION_LINES` lines (from its ``def`` to its last line, docstring included).

A function's length is counted from the line of its name to the line of its closing brace, both included.
The scanner is small and textual: it blanks out comments, string and character literals and preprocessor
lines (keeping the line breaks), then matches braces. A brace at namespace or class scope whose header looks
like a function declarator (``name(...)`` followed by qualifiers, a trailing return type or a constructor's
initializer list) opens a function; everything up to its matching brace (lambdas, local classes) belongs to it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
MAX_FUNCTION_LINES = 120
MAX_PYTHON_FUNCTION_LINES = 80
PACKAGE = ROOT / "hybridpipe"
ALLOWED = {"PYBIND11_MODULE"}  # the module definition lists every binding: one long, flat function
SUFFIXES = (".cpp", ".cc", ".h", ".hpp", ".cu", ".cuh")


@dataclass(frozen=True)
class Function:
    name: str
    path: Path
    first_line: int  # the line of its name
    last_line: int  # the line of its closing brace

    @property
    def lines(self) -> int:
        return self.last_line - self.first_line + 1


def blank_code(text: str) -> str:
    """`text` with comments, string and character literals (raw strings too) and preprocessor directives
    replaced by spaces; newlines stay, so offsets map to the same lines."""
    out = list(text)
    n = len(text)
    i = 0
    line_start = True  # only whitespace since the last newline

    def blank(start: int, end: int) -> None:
        for k in range(start, min(end, n)):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = text[i]
        if c == "\n":
            line_start = True
            i += 1
            continue
        if c in " \t\r\f\v":
            i += 1
            continue
        if line_start and c == "#":  # a directive, with its continuation lines
            end = i
            while end < n and not (text[end] == "\n" and text[end - 1] != "\\"):
                end += 1
            blank(i, end)
            i = end
            continue
        line_start = False
        if text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            blank(i, end)
            i = end
            continue
        if text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            blank(i, end)
            i = end
            continue
        raw = re.match(r'(?:u8|u|U|L)?R"([^()\\\s]{0,16})\(', text[i:i + 24])
        if raw and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            close = ")" + raw.group(1) + '"'
            end = text.find(close, i + raw.end())
            end = n if end < 0 else end + len(close)
            blank(i, end)
            i = end
            continue
        if c == '"' or (c == "'" and not digit_separator(text, i)):
            end = i + 1
            while end < n and text[end] != c and text[end] != "\n":
                end += 2 if text[end] == "\\" else 1
            blank(i, end + 1)
            i = end + 1
            continue
        i += 1
    return "".join(out)


def digit_separator(text: str, index: int) -> bool:
    """Whether the quote at `index` separates digits of a number (1'000) rather than opening a character literal
    (a prefixed one too: u8'x', L'x')."""
    start = index
    while start > 0 and (text[start - 1].isalnum() or text[start - 1] == "_"):
        start -= 1
    return start < index and text[start].isdigit()


CONTAINER = re.compile(r"\b(namespace|class|struct|union|enum|extern)\b")
# what may follow a declarator's parameter list before its body
QUALIFIERS = re.compile(r"\)\s*(?:(?:const|volatile|noexcept|override|final|mutable|&&?)\s*|noexcept\s*\([^()]*\)\s*"
                        r"|->\s*[^;{}()]+)*$")


def looks_like_function(head: str) -> bool:
    """Whether a brace with header `head` (the code since the last statement or scope boundary) opens a
    function body."""
    head = head.strip()
    if "(" not in head:
        return False
    before_paren = head[:head.index("(")]
    if CONTAINER.search(before_paren) or "=" in before_paren.replace("operator=", "").replace("==", ""):
        return False
    if QUALIFIERS.search(head):
        return True
    # a constructor's initializer list: `X::X(...) : a_(1), b_{2}`
    return re.search(r"\)\s*(?:noexcept\s*)?:[^:]", head) is not None and re.search(r"[)}]\s*$", head) is not None


def function_name(head: str) -> str:
    before_paren = head.strip()
    depth = 0
    for index, char in enumerate(before_paren):  # the first '(' outside template arguments
        if char == "<":
            depth += 1
        elif char == ">":
            depth -= 1
        elif char == "(" and depth <= 0:
            before_paren = before_paren[:index]
            break
    words = re.findall(r"[~\w:]+(?:\s*operator\s*\S+)?", before_paren)
    return words[-1].strip() if words else before_paren.strip()


def scan(path: Path) -> list[Function]:
    """Every function defined in `path`, outermost only (a lambda or local class belongs to its function)."""
    text = path.read_text()
    code = blank_code(text)
    line_of = [0] * (len(code) + 1)
    line = 1
    for index, char in enumerate(code):
        line_of[index] = line
        if char == "\n":
            line += 1
    line_of[len(code)] = line
    functions: list[Function] = []
    stack: list[str] = []  # kinds of the open braces: "scope", "function", "other"
    head_start = 0  # where the current header begins (at scope level)
    function_open: tuple[str, int] | None = None
    for index, char in enumerate(code):
        inside_function = "function" in stack
        if char == "{":
            if inside_function:
                stack.append("other")
                continue
            if stack and stack[-1] == "other":  # nested initializer braces at scope level
                stack.append("other")
                continue
            head = code[head_start:index]
            if looks_like_function(head):
                name = function_name(head)
                name_at = head_start + len(head) - len(head.lstrip())
                match = re.search(re.escape(name.split("::")[-1]) + r"\s*\(", head) if name else None
                if match:
                    name_at = head_start + match.start()
                stack.append("function")
                function_open = (name, line_of[name_at])
            elif CONTAINER.search(head) and "=" not in head:
                stack.append("scope")
                head_start = index + 1
            else:
                stack.append("other")  # an initializer: its braces are part of the next header
        elif char == "}":
            kind = stack.pop() if stack else "scope"
            if kind == "function" and "function" not in stack:
                assert function_open is not None
                functions.append(Function(function_open[0], path, function_open[1], line_of[index]))
                function_open = None
                head_start = index + 1
            elif kind == "scope" and not inside_function:
                head_start = index + 1
        elif char == ";" and not inside_function and not (stack and stack[-1] == "other"):
            head_start = index + 1
        elif char == ":" and not inside_function and re.search(r"\b(public|private|protected)\s*$",
                                                               code[head_start:index]):
            head_start = index + 1
    return functions


def long_functions(root: Path, limit: int = MAX_FUNCTION_LINES) -> list[Function]:
    found = []
    for path in sorted(p for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file()):
        found += [f for f in scan(path) if f.lines > limit and f.name not in ALLOWED]
    return found


def describe(functions: list[Function]) -> str:
    return "\n".join(f"  {f.path.relative_to(f.path.parents[1])}:{f.first_line}: {f.name} ({f.lines} lines)"
                     for f in functions)


def test_no_long_functions_in_csrc():
    too_long = long_functions(CSRC)
    assert not too_long, (f"C++ functions over {MAX_FUNCTION_LINES} lines (split them; only the pybind11 module "
                          f"may be longer):\n{describe(too_long)}")


def test_scanner_finds_every_function_of_the_extension():
    """The scanner sees real code: the engine's known functions, at their real lengths, and the module."""
    found = {f.name: f for path in sorted(CSRC.rglob("*.cpp")) for f in scan(path)}
    for name in ("Engine::run", "Engine::shutdown", "Engine::wait", "TensorQueue::wait", "Controller::slow_round",
                 "BucketExecutor::execute", "PYBIND11_MODULE"):
        assert name in found, f"the scanner missed {name}; it found {sorted(found)}"
    assert found["PYBIND11_MODULE"].lines > MAX_FUNCTION_LINES  # the one allowed: it is seen, and excused
    shutdown = found["Engine::shutdown"]
    lines = shutdown.path.read_text().splitlines()
    assert lines[shutdown.first_line - 1].startswith("void Engine::shutdown()")
    assert lines[shutdown.last_line - 1] == "}"


LONG_BODY = "\n".join(f"  total += {i};  // a comment with a brace {{" for i in range(130))


def test_scanner_reports_a_planted_long_function(tmp_path):
    source = tmp_path / "planted.cpp"
    source.write_text(
        "#include <string>\n"
        "#define OPEN {\n"
        "namespace demo {\n"
        "namespace {\n"
        "const char* brace = \"}}}\";  /* } */\n"
        "const char close = '}';\n"
        "struct Short { int get() const { return 1; } int values[2] = {1, 2}; };\n"
        "}  // namespace\n"
        "class Holder {\n"
        " public:\n"
        "  Holder() : value_{0}, text_(\"{\") {}\n"
        "  int value_;\n"
        "  std::string text_;\n"
        "};\n"
        "int Holder_long(int total) noexcept {\n"
        "  auto lambda = [&](int x) { return x + total; };\n"
        f"{LONG_BODY}\n"
        "  return lambda(total);\n"
        "}\n"
        "template <typename T>\n"
        "T just_under(T total) {\n"
        + "\n".join(f"  total += {i};" for i in range(MAX_FUNCTION_LINES - 2)) + "\n"
        "}\n"
        "}  // namespace demo\n"
        "PYBIND11_MODULE(_C, m) {\n"
        + "\n".join(f"  m.attr(\"x{i}\") = {i};" for i in range(200)) + "\n"
        "}\n")
    found = {f.name: f for f in scan(source)}
    assert set(found) == {"get", "Holder", "Holder_long", "just_under", "PYBIND11_MODULE"}
    assert found["Holder_long"].lines == 130 + 4
    assert found["Holder_long"].first_line == 15
    assert found["just_under"].lines == MAX_FUNCTION_LINES
    too_long = long_functions(tmp_path)
    assert [(f.name, f.lines) for f in too_long] == [("Holder_long", 134)]
    assert "planted.cpp:15: Holder_long (134 lines)" in describe(too_long)


def long_python_functions(root: Path, limit: int = MAX_PYTHON_FUNCTION_LINES) -> list[str]:
    """``path:line name (N lines)`` of every function or method under ``root`` longer than ``limit`` lines."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > limit:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_long_python_functions_in_the_package():
    long = long_python_functions(PACKAGE)
    assert not long, (f"functions over {MAX_PYTHON_FUNCTION_LINES} lines (split them by concern):\n"
                      + "\n".join(long))


def test_the_python_check_finds_a_planted_long_function(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_PYTHON_FUNCTION_LINES))  # def + 80 lines: 81
    (package / "module.py").write_text(f"def short():\n    return 1\n\n\nclass C:\n    def long(self):\n{body}\n")
    assert long_python_functions(package) == [f"pkg/module.py:6 long ({MAX_PYTHON_FUNCTION_LINES + 1} lines)"]
