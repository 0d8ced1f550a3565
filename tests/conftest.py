"""pytest plugin that runs MPI test files under a real mpirun, one launch per rank count.

A file opts in with ``pytestmark = pytest.mark.mpi(ranks=[2, 4])`` (optionally ``timeout=``
seconds; ``shared=True`` runs it in one mpirun with the other shared files of the same rank count, see
:class:`MpiItem`). The parent pytest never imports such a file (importing mpi4py.MPI would initialise
MPI in it): it reads the marker with ``ast`` and collects one item per rank count, ``mpi[np2]``,
whose run is ``mpirun -n 2 python -m pytest FILE``. Inside that launch (``HYBRIDPIPE_UNDER_MPIRUN=1``)
every rank collects normally, sends its output to ``rank<r>.log`` and its results to
``rank<r>.json``; the item passes only when every rank passed the same tests, and otherwise fails
with every rank's log. Debug one file by hand with
``HYBRIDPIPE_UNDER_MPIRUN=1 mpirun -n 2 python -m pytest -s tests/test_x.py``.
"""

from __future__ import annotations

import ast
import faulthandler
import fnmatch
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

collect_ignore = ["harness_cases"]  # the plugin's own test cases, run by test_harness.py


# ------------------------------------------------------------ emulated hosts (tests across hosts)


def _two_emulated_hosts() -> Iterator[Any]:
    """Two emulated hosts (hybridpipe.testing.emulated_hosts), removed afterwards; the test is skipped
    only where they are unsupported (no root, ip, unshare): a failure to build them fails it."""
    from hybridpipe.testing.emulated_hosts import EmulatedHosts, EmulatedHostsError

    try:
        EmulatedHosts.check_supported()
    except EmulatedHostsError as error:
        pytest.skip(f"cannot build emulated hosts here: {error}")
    hosts = EmulatedHosts(2).up()
    try:
        yield hosts
    finally:
        hosts.down()


@pytest.fixture(scope="module")
def emulated_hosts() -> Iterator[Any]:
    """Two emulated hosts shared by the tests of a module."""
    yield from _two_emulated_hosts()


@pytest.fixture
def fresh_emulated_hosts() -> Iterator[Any]:
    """Two emulated hosts for one test."""
    yield from _two_emulated_hosts()

UNDER_MPIRUN = os.environ.get("HYBRIDPIPE_UNDER_MPIRUN") == "1"
DEFAULT_TIMEOUT_S = 300.0
STOP_GRACE_S = 10.0  # after SIGTERM: time for ranks to dump their stacks and mpirun to clean up
LOG_TAIL_LINES = 200
RANK_VARIABLES = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MPI_LOCALRANKID")
SIZE_VARIABLES = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
OUTCOMES = ("passed", "failed", "error", "skipped")
_SUMMARY = pytest.StashKey[list[str]]()


@pytest.hookimpl(tryfirst=True)  # redirect output before pytest's faulthandler duplicates stderr
def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "mpi(ranks, timeout=300, long_ranks=()): module-level pytestmark; run the file under "
        "mpirun once per rank count in ranks (an int or a list of ints), and in long_ranks too when "
        "HYBRIDPIPE_LONG_TESTS=1 (make test-long); shared=True: in one mpirun with the other shared files "
        "of that rank count"
    )
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped without one")
    config.stash[_SUMMARY] = []
    report_dir = os.environ.get("HYBRIDPIPE_TEST_REPORT_DIR")
    if UNDER_MPIRUN and report_dir:
        config.pluginmanager.register(RankReporter(Path(report_dir)), "hybridpipe-rank-reporter")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Before each test of the parent process: the session directories of Open MPI launchers that earlier tests
    (timeouts, failure tests) killed are removed, or a later mpirun that draws the same pid fails to start
    (hybridpipe.launch.remove_stale_session_dirs; this machine reuses pids within the hour)."""
    if not UNDER_MPIRUN:
        from hybridpipe.launch import remove_stale_session_dirs

        remove_stale_session_dirs()


# ------------------------------------------------------------ reading the marker (parent)


class MarkerError(ValueError):
    """A module-level ``pytest.mark.mpi`` that cannot be read without importing the file."""


@dataclass(frozen=True)
class MpiSpec:
    """What the parent knows of an MPI test file without importing it."""

    ranks: tuple[int, ...]
    timeout_s: float
    bare_marks: frozenset[str]  # module-level marks given without arguments, e.g. "cuda"
    tests: tuple[frozenset[str], ...]  # per test: its function, class and mark names (for -k)
    long_ranks: tuple[int, ...] = ()  # launched only with HYBRIDPIPE_LONG_TESTS=1 (make test-long)
    shared: bool = False  # runs in one mpirun with the other shared files of the same rank count


def _mark_name(node: ast.expr) -> str | None:
    """``NAME`` for ``pytest.mark.NAME`` or ``mark.NAME``, called or not; else None."""
    target = node.func if isinstance(node, ast.Call) else node
    if isinstance(target, ast.Attribute) and ast.unparse(target.value).split(".")[-1] == "mark":
        return target.attr
    return None


def _parse_mpi_call(call: ast.Call) -> tuple[tuple[int, ...], float, tuple[int, ...], bool]:
    arguments = {keyword.arg: keyword.value for keyword in call.keywords}
    if call.args or "ranks" not in arguments or set(arguments) - {"ranks", "timeout", "long_ranks", "shared"}:
        raise MarkerError("write it as pytest.mark.mpi(ranks=N or [N1, N2], timeout=SECONDS, "
                          "long_ranks=[N3] (only in make test-long), shared=True (one mpirun with the other "
                          "shared files))")
    try:
        ranks = ast.literal_eval(arguments["ranks"])
        timeout = ast.literal_eval(arguments.get("timeout", ast.Constant(DEFAULT_TIMEOUT_S)))
        long_ranks = ast.literal_eval(arguments.get("long_ranks", ast.Tuple(elts=[], ctx=ast.Load())))
        shared = ast.literal_eval(arguments.get("shared", ast.Constant(False)))
    except ValueError:
        raise MarkerError("ranks, timeout, long_ranks and shared must be literals, not names or expressions") from None
    if not isinstance(shared, bool):
        raise MarkerError(f"shared must be True or False (got {shared!r})")
    ranks = [ranks] if isinstance(ranks, int) else ranks
    long_ranks = [long_ranks] if isinstance(long_ranks, int) else long_ranks
    for name, value, allow_empty in (("ranks", ranks, False), ("long_ranks", long_ranks, True)):
        if not isinstance(value, (list, tuple)) or (not value and not allow_empty) or not all(
            type(n) is int and n > 0 for n in value
        ):
            raise MarkerError(f"{name} must be a positive int or a list of them (got {value!r})")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise MarkerError(f"timeout must be a positive number of seconds (got {timeout!r})")
    return tuple(ranks), float(timeout), tuple(long_ranks), shared


def _test_names(tree: ast.Module, config: pytest.Config) -> tuple[frozenset[str], ...]:
    """Names that -k matches for each test in the file (as pytest collects them)."""

    def matches(option: str, name: str) -> bool:  # pytest's python_functions / python_classes rule
        return any(
            name.startswith(p) or (any(c in p for c in "*?[") and fnmatch.fnmatch(name, p))
            for p in config.getini(option)
        )

    def marks(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> set[str]:
        return {name for decorator in node.decorator_list if (name := _mark_name(decorator))}

    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    tests = []
    for node in tree.body:
        if isinstance(node, functions) and matches("python_functions", node.name):
            tests.append(frozenset({node.name, *marks(node)}))
        elif isinstance(node, ast.ClassDef) and matches("python_classes", node.name):
            tests += [
                frozenset({node.name, *marks(node), method.name, *marks(method)})
                for method in node.body
                if isinstance(method, functions) and matches("python_functions", method.name)
            ]
    return tuple(tests)


def read_mpi_spec(path: Path, config: pytest.Config) -> MpiSpec | None:
    """The file's module-level ``pytest.mark.mpi``, or None when it has none.

    Raises:
        MarkerError: The marker is there but its arguments are not literals.
    """
    source = path.read_bytes()
    if b"mpi" not in source:
        return None
    try:
        tree = ast.parse(source, filename=str(path))
    except SyntaxError:
        return None  # the normal import reports it
    for node in tree.body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["pytestmark"]:
            value = node.value
            marks = value.elts if isinstance(value, (ast.List, ast.Tuple)) else [value]
            mpi_calls = [m for m in marks if isinstance(m, ast.Call) and _mark_name(m) == "mpi"]
            if mpi_calls:
                ranks, timeout, long_ranks, shared = _parse_mpi_call(mpi_calls[0])
                bare = {name for m in marks if not isinstance(m, ast.Call) and (name := _mark_name(m))}
                return MpiSpec(ranks, timeout, frozenset(bare), _test_names(tree, config), long_ranks, shared)
    return None


# ------------------------------------------------------------ collecting and launching (parent)


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if UNDER_MPIRUN:
        return None
    try:
        spec = read_mpi_spec(module_path, parent.config)
    except MarkerError as error:
        return MpiFile.from_parent(parent, path=module_path, spec=None, error=str(error))
    return None if spec is None else MpiFile.from_parent(parent, path=module_path, spec=spec, error=None)


class MpiFile(pytest.File):
    """An MPI test file seen from the parent: one :class:`MpiItem` per rank count."""

    def __init__(self, *, spec: MpiSpec | None, error: str | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.spec, self.error = spec, error

    def collect(self) -> Iterator[MpiItem]:
        if self.spec is None:
            raise self.CollectError(f"{self.path}: unreadable pytest.mark.mpi ({self.error})")
        long = os.environ.get("HYBRIDPIPE_LONG_TESTS") == "1"
        for ranks in (*self.spec.ranks, *(self.spec.long_ranks if long else ())):
            yield MpiItem.from_parent(self, name=f"mpi[np{ranks}]", ranks=ranks, spec=self.spec)


class MpiLaunchFailed(Exception):
    """An MPI launch failed; the message is the whole report."""


_SHARED = pytest.StashKey[dict[int, "Launch"]]()


class MpiItem(pytest.Item):
    """One ``mpirun -n N python -m pytest FILE`` launch.

    A file marked ``shared=True`` runs instead in one launch with every other selected shared file of
    the same rank count (``mpirun -n N python -m pytest FILE1 FILE2 ...``, made by the first of their
    items to run): a launch costs 5-7 s of start-up here (MPI, then torch imported by every rank), more
    than most files' tests. Each file's item still passes or fails on its own tests; a launch that times
    out (after the longest of the files' timeouts) or loses a rank fails every file in it. Shared files must leave the process as they found it
    (hybridpipe shut down by their fixtures, no environment changes).
    """

    def __init__(self, *, ranks: int, spec: MpiSpec, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ranks, self.spec = ranks, spec
        self.timeout_s = spec.timeout_s * float(os.environ.get("HYBRIDPIPE_TEST_TIMEOUT_SCALE", "1"))
        self.add_marker(pytest.mark.mpi(ranks=ranks, timeout=spec.timeout_s))
        for name in spec.bare_marks - {"mpi"}:
            self.add_marker(name)

    def keyword_match(self, expression: Any) -> frozenset[str] | None:
        """Names of the first test in the file that the -k ``expression`` selects, else None."""
        chain = [n.name for n in self.parent.listchain() if not isinstance(n, pytest.Session)]
        base = {*chain[1:], "mpi", f"np{self.ranks}", *self.spec.bare_marks}  # [0]: root dir
        for names in self.spec.tests:
            candidates = [name.lower() for name in base | names]
            if expression.evaluate(lambda sub, **_: any(sub.lower() in name for name in candidates)):
                return names
        return None

    def runtest(self) -> None:
        config = self.config
        if not self.spec.shared:
            launch = self._launch([self])
            only = None
        else:
            shared = config.stash.setdefault(_SHARED, {})
            if self.ranks not in shared:  # the first shared file of this rank count launches them all
                batch = [item for item in self.session.items
                         if isinstance(item, MpiItem) and item.spec.shared and item.ranks == self.ranks]
                shared[self.ranks] = self._launch(batch)
            launch, only = shared[self.ranks], self.parent.nodeid
        config.stash[_SUMMARY].append(launch.summary(only))
        if launch.problems(only):
            raise MpiLaunchFailed(launch.failure_report(only))
        if only is None or (only == launch.files[-1] and not any(launch.problems(file) for file in launch.files)):
            shutil.rmtree(launch.report_dir, ignore_errors=True)  # kept while a failure report points to it
        reason = launch.skip_reason(only)
        if reason is not None:
            pytest.skip(reason)

    def _launch(self, items: list[MpiItem]) -> Launch:
        """Runs the files of ``items`` (this rank count) in one mpirun; returns the finished launch."""
        from hybridpipe.launch import available_cores, mpirun_command  # plain runs skip hybridpipe

        config = self.config
        report_dir = Path(tempfile.mkdtemp(prefix=f"hybridpipe-np{self.ranks}-"))
        argv = [sys.executable, "-m", "pytest", *(str(item.path) for item in items), "-q", "-s",
                "-p", "no:cacheprovider"]
        if len(items) > 1:
            argv.append("--continue-on-collection-errors")  # one file's import error leaves the others' verdicts
        argv.append(f"--rootdir={config.rootpath}")
        if config.inipath is not None:
            argv += ["-c", str(config.inipath)]
        if config.option.keyword:
            argv += ["-k", config.option.keyword]
        env = {"HYBRIDPIPE_UNDER_MPIRUN": "1", "HYBRIDPIPE_TEST_REPORT_DIR": str(report_dir)}
        if self.ranks > available_cores():
            env["OMPI_MCA_mpi_yield_when_idle"] = "1"
        command = mpirun_command(self.ranks, argv, env=env)
        launch = Launch(self.parent.nodeid, self.ranks, command, report_dir,
                        files=[item.parent.nodeid for item in items])
        # the longest of the files' own limits: each is generous for its file alone, and the shared files
        # together take well under a minute here (summing them would let a hang run for an hour)
        launch.run(max(item.timeout_s for item in items), cwd=config.invocation_params.dir)
        return launch

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException], style: Any = None) -> str:
        if isinstance(excinfo.value, MpiLaunchFailed):
            return str(excinfo.value)
        return str(super().repr_failure(excinfo, style=style))

    def reportinfo(self) -> tuple[Path, int, str]:
        return self.path, 0, self.name  # a line (the file's first) lets pytest report a skip marker's location


def _session_members(session_id: int) -> list[int]:
    """Pids in a session (from Linux /proc; none elsewhere). mpirun puts every rank in a
    process group of its own, so killing mpirun's group alone can leave ranks running."""
    members = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[3]) == session_id:
                members.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return members


def _stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM mpirun (it forwards it; ranks dump their stacks), then SIGKILL its whole session."""
    if process.poll() is not None:
        return
    os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
    for pid in _session_members(process.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    process.wait()


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    if not path.exists():
        return "(no output file)"
    text = path.read_text(errors="replace").splitlines()
    cut = f"... ({len(text) - lines} earlier lines in {path})\n" if len(text) > lines else ""
    return cut + "\n".join(text[-lines:])


@dataclass
class Launch:
    """One mpirun of one test file (or of several shared ones): the command, what came back, and the
    verdict. Methods taking ``only`` (a file's node id) judge that file's tests alone."""

    file: str
    ranks: int
    command: list[str]
    report_dir: Path
    exit_code: int | None = None
    timed_out_after_s: float | None = None
    elapsed_s: float = 0.0
    reports: dict[int, dict[str, Any]] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

    def _tests(self, report: dict[str, Any], only: str | None) -> list[dict[str, Any]]:
        return [test for test in report["tests"]
                if only is None or test["nodeid"] == only or test["nodeid"].startswith(only + "::")]

    def run(self, timeout_s: float, cwd: Path) -> None:
        start = time.monotonic()
        with open(self.report_dir / "mpirun.log", "wb") as output:
            process = subprocess.Popen(
                self.command, cwd=cwd, stdin=subprocess.DEVNULL, stdout=output,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
            try:
                process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.timed_out_after_s = timeout_s
            finally:  # also on KeyboardInterrupt
                _stop(process)
        self.elapsed_s = time.monotonic() - start
        self.exit_code = process.returncode
        for rank in range(self.ranks):
            path = self.report_dir / f"rank{rank}.json"
            if path.exists():
                self.reports[rank] = json.loads(path.read_text())

    def problems(self, only: str | None = None) -> list[str]:
        found = []
        if self.timed_out_after_s is not None:
            found.append(f"timed out after {self.timed_out_after_s:g} s (the ranks got SIGTERM; "
                         "their Python stacks are at the end of their logs)")
        missing = [rank for rank in range(self.ranks) if rank not in self.reports]
        # in a shared launch, a failed test of another file makes pytest (and mpirun) exit 1: only a
        # rank that did not end its tests normally concerns every file
        tests_decide = only is not None and not missing and all(
            report["exitstatus"] in (0, 1) for report in self.reports.values())
        if self.exit_code != 0 and not tests_decide:
            found.append(f"mpirun exit code {self.exit_code}")
        if missing:
            found.append(f"no report from ranks {missing} (crashed, killed, or pytest never ended)")
        empty = [rank for rank, report in self.reports.items()
                 if report["exitstatus"] == 5 or (only is not None and not self._tests(report, only))]
        if empty:
            found.append(f"no tests collected on ranks {empty}" + (" (pytest exit code 5)" if only is None else ""))
        outcomes = {rank: {t["nodeid"]: t["outcome"] for t in self._tests(report, only)}
                    for rank, report in self.reports.items()}
        for nodeid in sorted({nodeid for by_test in outcomes.values() for nodeid in by_test}):
            ranks_by_outcome: dict[str, list[int]] = {}
            for rank in sorted(outcomes):
                ranks_by_outcome.setdefault(outcomes[rank].get(nodeid, "not run"), []).append(rank)
            if set(ranks_by_outcome) & {"failed", "error", "not run"}:
                detail = ", ".join(f"{outcome} on ranks {r}" for outcome, r in ranks_by_outcome.items())
                found.append(f"{nodeid}: {detail}")
        return found

    def failure_report(self, only: str | None = None) -> str:
        files = " ".join(self.files) if len(self.files) > 1 else self.file
        lines = [f"mpirun -n {self.ranks} {files} failed" + (f" for {only}:" if only and len(self.files) > 1 else ":")]
        lines += [f"  - {problem}" for problem in self.problems(only)]
        lines += [f"command: {shlex.join(self.command)}", f"logs kept in: {self.report_dir}"]
        for rank in range(self.ranks):
            lines += [f"{'=' * 25} rank {rank} log {'=' * 25}", _tail(self.report_dir / f"rank{rank}.log")]
        lines += [f"{'=' * 25} mpirun output {'=' * 25}", _tail(self.report_dir / "mpirun.log")]
        return "\n".join(lines)

    def skip_reason(self, only: str | None = None) -> str | None:
        """Why the launch counts as skipped (every test skipped on every rank), else None."""
        tests = [test for report in self.reports.values() for test in self._tests(report, only)]
        if any(test["outcome"] != "skipped" for test in tests):
            return None
        reasons = "; ".join(sorted({test["longrepr"] for test in tests}))
        return f"every test skipped on all {self.ranks} ranks: {reasons}"

    def summary(self, only: str | None = None) -> str:
        head = f"mpi[np{self.ranks}] {only or self.file}: "
        if only is not None and len(self.files) > 1:
            took = sum(test["duration"] for test in self._tests(self.reports.get(0, {"tests": []}), only))
            elapsed = f" ({took:.1f} s of a launch shared by {len(self.files)} files, {self.elapsed_s:.1f} s)"
        else:
            elapsed = f" ({self.elapsed_s:.1f} s)"
        if self.timed_out_after_s is not None:
            return f"{head}timed out after {self.timed_out_after_s:g} s"
        counts = {rank: "no report" for rank in range(self.ranks)}
        for rank, report in self.reports.items():
            tally = Counter(test["outcome"] for test in self._tests(report, only))
            counts[rank] = ", ".join(f"{tally[o]} {o}" for o in OUTCOMES if tally[o]) or "no tests"
        if len(set(counts.values())) == 1:
            return f"{head}{counts[0]} on each of {self.ranks} ranks{elapsed}"
        return head + "; ".join(f"rank {rank}: {text}" for rank, text in counts.items()) + elapsed


# ------------------------------------------------------------ inside mpirun (child)


def _first_int(variables: tuple[str, ...]) -> int | None:
    return next((int(os.environ[name]) for name in variables if name in os.environ), None)


class RankReporter:
    """Child-side plugin: this rank's output goes to ``rank<r>.log``, its results to
    ``rank<r>.json``, and SIGTERM (a timeout) dumps its Python stack into the log."""

    def __init__(self, report_dir: Path) -> None:
        rank = _first_int(RANK_VARIABLES)
        if rank is None:
            raise pytest.UsageError(f"HYBRIDPIPE_UNDER_MPIRUN=1 but none of {RANK_VARIABLES} is set")
        self.report_path = report_dir / f"rank{rank}.json"
        self.tests: dict[str, dict[str, Any]] = {}
        sys.stdout.flush()
        sys.stderr.flush()
        log = os.open(report_dir / f"rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
        faulthandler.register(signal.SIGTERM, file=sys.stderr, all_threads=True, chain=True)

    def _entry(self, nodeid: str) -> dict[str, Any]:
        fresh = {"nodeid": nodeid, "outcome": "passed", "duration": 0.0, "longrepr": ""}
        return self.tests.setdefault(nodeid, fresh)

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self._entry(report.nodeid).update(outcome="error", longrepr=report.longreprtext)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        entry = self._entry(report.nodeid)
        entry["duration"] += report.duration
        if report.failed:
            if entry["outcome"] != "failed":
                entry["outcome"] = "failed" if report.when == "call" else "error"
            entry["longrepr"] += report.longreprtext
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
            if hasattr(report, "wasxfail"):
                entry["longrepr"] = f"xfail: {report.wasxfail}"
            elif isinstance(report.longrepr, tuple):
                entry["longrepr"] = report.longrepr[2]

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, exitstatus: int) -> None:
        partial = self.report_path.with_suffix(".partial")
        partial.write_text(json.dumps({"exitstatus": int(exitstatus), "tests": list(self.tests.values())}))
        partial.replace(self.report_path)


# ------------------------------------------------------------ both modes


def _deselect_mpi_items_by_keyword(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Apply -k to MPI files test by test: pytest's own -k sees only "mpi[npN]" in the parent."""
    try:  # the parser behind -k itself: private, but there since pytest 6
        from _pytest.mark.expression import Expression

        expression = Expression.compile(config.option.keyword.lstrip())
    except Exception:  # moved, or a bad expression that pytest's own -k reports
        return
    deselected = []
    for item in items:
        if isinstance(item, MpiItem):
            names = item.keyword_match(expression)
            if names is None:
                deselected.append(item)
            else:  # so that pytest's own -k, which runs next, keeps the item too
                item.extra_keyword_matches.update(names)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = [item for item in items if item not in deselected]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if UNDER_MPIRUN:
        for item in items:  # so that "-k np4" means the same here as in the parent
            item.extra_keyword_matches.add(f"np{_first_int(SIZE_VARIABLES)}")
    elif config.option.keyword.strip():
        _deselect_mpi_items_by_keyword(config, items)
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if cuda_items:
        import torch

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
            for item in cuda_items:
                item.add_marker(skip)


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    lines = config.stash.get(_SUMMARY, [])
    if lines:
        terminalreporter.write_sep("-", "MPI launches")
        for line in lines:
            terminalreporter.write_line(line)
