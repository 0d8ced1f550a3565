"""The errors' structure: every exception class of the package lives in ``hybridpipe/errors.py`` and is exported
as ``hp.<Name>``; misuse raises a ``ValueError``/``TypeError`` kind; the base class is only ever caught, never
raised bare; one ``RemoteError``."""

from __future__ import annotations

import ast
import pickle
import re
import sys
from pathlib import Path

import hybridpipe as hp
from hybridpipe import errors

PACKAGE = Path(__file__).resolve().parents[1] / "hybridpipe"
EXCEPTION_BASES = {"Exception", "BaseException", "RuntimeError", "ValueError", "TypeError", "KeyError",
                   "ImportError", "TimeoutError", "OSError", *errors.__all__}


def exception_classes(tree: ast.AST) -> list[str]:
    """Public classes in ``tree`` that derive (by a base's written name) from an exception class."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            bases = {base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "") for base in node.bases}
            if bases & EXCEPTION_BASES:
                found.append(node.name)
    return found


def bare_base_raises(tree: ast.AST) -> list[int]:
    """Lines that raise (or return, for a caller to raise) ``HybridPipeError(...)`` itself."""
    lines = []
    for node in ast.walk(tree):
        value = node.exc if isinstance(node, ast.Raise) else node.value if isinstance(node, ast.Return) else None
        if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "HybridPipeError":
            lines.append(node.lineno)
    return lines


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE), ast.parse(path.read_text())


def test_every_exception_class_is_in_errors_py():
    elsewhere = {str(path): names for path, tree in modules() if str(path) != "errors.py"
                 for names in [exception_classes(tree)] if names}
    assert not elsewhere, f"exception classes outside hybridpipe/errors.py: {elsewhere}; define them there"


def test_the_finder_sees_a_class_outside_errors_py():
    planted = ast.parse("class Oops(HybridPipeError):\n    pass\nclass _Flow(BaseException):\n    pass\n")
    assert exception_classes(planted) == ["Oops"]


def test_every_class_of_errors_py_is_exported():
    defined = {node.name for node in ast.parse((PACKAGE / "errors.py").read_text()).body
               if isinstance(node, ast.ClassDef)}
    assert defined == set(errors.__all__), f"errors.__all__ differs from the classes: {defined ^ set(errors.__all__)}"
    missing = [name for name in defined if getattr(hp, name, None) is not getattr(errors, name)
               or name not in hp.__all__]
    assert not missing, f"not exported as hp.<name>: {missing}"


def test_the_base_class_is_never_raised_bare():
    raised = {str(path): lines for path, tree in modules() for lines in [bare_base_raises(tree)] if lines}
    assert not raised, (f"raise HybridPipeError(...) at {raised}: raise UsageError (misuse, with the fix) or the "
                        "runtime class that says what failed")
    assert bare_base_raises(ast.parse("def f():\n    raise HybridPipeError('x')\n")) == [2]


def test_misuse_classes_are_value_errors():
    for name in ("UsageError", "GridError", "PartitionError", "SplitError", "ScheduleError", "DuplicateNameError",
                 "PipeDreamProfileError"):
        cls = getattr(hp, name)
        assert issubclass(cls, hp.UsageError) and issubclass(cls, ValueError) and issubclass(cls, hp.HybridPipeError)
    for name in ("RemoteError", "PeerShutDownError", "WaitTimeoutError", "PipelineBroken", "NonFiniteError",
                 "CheckpointError", "MismatchError", "MPIError", "RanksJoined", "InternalError"):
        assert not issubclass(getattr(hp, name), ValueError), name


def test_one_remote_error_for_pipeline_and_agreement():
    from hybridpipe.comm import agree, p2p

    assert p2p.RemoteError is agree.RemoteError is hp.RemoteError
    forwarded = hp.RemoteError("stage 1 (rank 1 of the pipeline) raised ValueError: x", source=1)
    unsendable = hp.RemoteError.of_type("mymodule.Odd", "it broke", 3)
    assert str(unsendable) == "mymodule.Odd on rank 3: it broke"
    assert (unsendable.rank, unsendable.type_name, unsendable.remote_message) == (3, "mymodule.Odd", "it broke")
    for error in (forwarded, unsendable):
        copy = pickle.loads(pickle.dumps(error))
        assert (str(copy), copy.source, copy.type_name) == (str(error), error.source, error.type_name)


def test_a_bad_setting_is_a_usage_error_naming_it():
    import pytest

    with pytest.raises(hp.UsageError, match=r"HYBRIDPIPE_TIMEOUT_SECONDS='5m' is not a number of seconds") as caught:
        hp.Config.from_env({"HYBRIDPIPE_TIMEOUT_SECONDS": "5m"})
    assert isinstance(caught.value, ValueError)


def test_the_docs_show_each_registry_as_it_is():
    from hybridpipe import registry

    docs = Path(__file__).resolve().parents[1] / "docs"
    for page, table in (("pipeline.md", registry.RECOMPUTE_MODES), ("pipeline.md", registry.PRECISIONS),
                        ("data_parallel.md", registry.ZERO_LEVELS)):
        assert registry.markdown_table(table) in (docs / page).read_text(), (
            f"docs/{page} lacks the registry's table (paste hybridpipe.registry.markdown_table's output)")


def test_every_user_of_an_option_asks_its_registry():
    from hybridpipe import registry
    from hybridpipe.data_parallel import zero
    from hybridpipe.pipeline import stage
    from hybridpipe.plan import cost, search
    from hybridpipe.testing import compatibility

    assert zero.LEVELS == compatibility.OPTIONS["zero"] == tuple(registry.ZERO_LEVELS)
    assert cost.ZERO_LEVELS == tuple(level for level, entry in registry.ZERO_LEVELS.items() if entry.planned)
    assert stage.CHECKPOINT_MODES == search.CHECKPOINT_CHOICES == tuple(registry.RECOMPUTE_MODES)
    assert tuple(cost.PRECISION_BYTES) == compatibility.OPTIONS["precision"] == tuple(registry.PRECISIONS)
    listed = re.compile(r"\(\s*0\s*,\s*1\s*,\s*2\s*\)|\(\s*\"fp32\"\s*,\s*\"bf16\"|\(\s*\"never\"\s*,\s*\"except_last\"")
    by_hand = [str(path.relative_to(PACKAGE)) for path in PACKAGE.rglob("*.py")
               if path.name != "registry.py" and listed.search(path.read_text())]
    assert not by_hand, f"option values listed by hand in {by_hand}: ask hybridpipe.registry"


def test_registry_checks_name_the_values():
    import pytest
    from hybridpipe import registry

    with pytest.raises(hp.UsageError, match=r"zero must be one of 0, 1, 2, 3 \(got 4\): 0: every replica keeps"):
        registry.check_zero_level(4)
    with pytest.raises(hp.UsageError, match=r"zero must be one of"):
        registry.check_zero_level(True)
    with pytest.raises(hp.UsageError, match=r"unknown checkpoint mode 'sometimes' \(use one of 'never', "):
        registry.check_recompute_mode("sometimes")
    with pytest.raises(hp.UsageError, match=r"unknown precision 'fp8': use one of 'fp32', 'bf16', 'fp16'"):
        registry.check_precision("fp8")


def test_warn_user_names_the_users_line_not_the_library_lines_the_warning_passed_through():
    import contextlib
    import warnings

    # a function whose code counts as hybridpipe's (its file is in the package), called through contextlib
    library = {"warn_user": errors.warn_user, "contextlib": contextlib}
    exec(compile("def deep(message):\n    with contextlib.nullcontext():\n        warn_user(message)\n"
                 "def deeper(message):\n    deep(message)\n", str(PACKAGE / "_in_the_library.py"), "exec"), library)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        library["deeper"]("from the library")  # this line is the user's
        user_line = sys._getframe().f_lineno - 1
        errors.warn_user("here", RuntimeWarning)
        direct_line = sys._getframe().f_lineno - 1
    assert [(w.filename, w.lineno, str(w.message), w.category) for w in caught] == [
        (__file__, user_line, "from the library", UserWarning), (__file__, direct_line, "here", RuntimeWarning)]
