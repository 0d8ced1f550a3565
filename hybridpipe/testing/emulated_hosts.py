"""Emulated hosts: network namespaces joined by a bridge, one per "host", to run an MPI job as on a cluster.

Each host is a network namespace with its own address and hostname; the job's launcher reaches a host
through a stand-in for ssh (an "agent" script) that runs the MPI daemon's command inside that host's
namespace. Ranks of one host share memory (MPI_COMM_TYPE_SHARED groups them, the shared-memory
allreduce serves them); ranks of different hosts talk over TCP through the bridge, whose links can be
rate-limited and delayed with ``tc netem`` and cut with ``ip link set ... down``.

Command line (needs root)::

    python -m hybridpipe.testing.emulated_hosts run --hosts 2 --ranks-per-host 2 [--rate 1gbit]
        [--delay 0.2ms] [--mpi openmpi|mpich] -- python script.py args...
    python -m hybridpipe.testing.emulated_hosts up --hosts 2 [--name NAME]   # prints how to launch
    python -m hybridpipe.testing.emulated_hosts down [--name NAME]

From Python (tests, benchmarks)::

    with EmulatedHosts(2, rate="1gbit") as hosts:
        subprocess.run(hosts.mpirun_command(2, [sys.executable, "train.py"]))
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hybridpipe.errors import EmulatedHostsError
from hybridpipe.launch import find_mpirun, mpi_flavour, mpirun_command

__all__ = ["EmulatedHosts", "EmulatedHostsError", "forwarded_environment", "main"]

STATE_DIR = Path(os.environ.get("HYBRIDPIPE_EMULATED_HOSTS_DIR", "/run/hybridpipe-emulated-hosts"))

# ssh stand-in: AGENT [ssh options] HOST COMMAND... runs COMMAND in HOST's namespace, with its hostname.
# Open MPI's PRRTE calls it as `AGENT HOST cmd`; MPICH's hydra as `AGENT -x HOST cmd`.
AGENT = """#!/bin/sh
while [ "${{1#-}}" != "$1" ]; do shift; done
host="$1"; shift
case "$host" in
{cases}
  *) echo "emulated-hosts agent: unknown host $host" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts /bin/sh -c "hostname $ns; $*"
"""


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise EmulatedHostsError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


def _tc(namespace: str, *args: str) -> None:
    result = subprocess.run(["ip", "netns", "exec", namespace, "tc", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise EmulatedHostsError(f"`tc {' '.join(args)}` in {namespace} failed: {result.stderr.strip()} "
                                 ""
                                 "(--delay needs the kernel's sch_netem module, --rate alone sch_tbf)")


_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}


def rate_bits_per_second(rate: str) -> float:
    """``"1gbit"`` -> 1e9 (tc's units: bit, kbit, mbit, gbit, tbit; bps, kbps, mbps, gbps are bytes)."""
    match = re.fullmatch(r"([0-9.]+)\s*([a-z]+)", rate.strip().lower())
    if not match or match.group(2) not in _RATE_UNITS:
        raise EmulatedHostsError(f"--rate {rate!r} is not a rate tc understands (use e.g. 100mbit, 1gbit, 10gbit)")
    return float(match.group(1)) * _RATE_UNITS[match.group(2)]


def _shaping(device: str, rate: str | None, delay: str | None) -> list[str]:
    """The tc qdisc for a host's link: tbf for a rate alone; netem when a delay is asked for."""
    if delay:  # netem does both; it needs the sch_netem kernel module
        return ["qdisc", "add", "dev", device, "root", "netem", "delay", delay,
                *(["rate", rate] if rate else []), "limit", "100000"]
    bits = rate_bits_per_second(rate or "")
    burst = max(int(bits / 8 / 100), 64 * 1024)  # 10 ms of traffic: enough for the kernel's timer granularity
    return ["qdisc", "add", "dev", device, "root", "tbf", "rate", rate or "", "burst", str(burst),
            "latency", "100ms"]


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.77.x.0/24 no interface of this machine is on."""
    taken = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
    start = os.getpid() % 150
    for offset in range(150):
        subnet = ipaddress.IPv4Network(f"10.77.{100 + (start + offset) % 150}.0/24")
        if f"{subnet.network_address + 1}/" not in taken and str(subnet.network_address)[:-1] not in taken:
            return subnet
    raise EmulatedHostsError("no free 10.77.x.0/24 subnet for emulated hosts (run `... down` for stale ones)")


def forwarded_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables every rank gets, as ``hybridpipe-run`` passes them: HYBRIDPIPE_*, OMP_NUM_THREADS,
    PATH and PYTHONPATH from this process, then ``extra``."""
    env = {name: value for name, value in os.environ.items()
           if name.startswith("HYBRIDPIPE_") or name in ("OMP_NUM_THREADS", "PATH", "PYTHONPATH")}
    env.pop("HYBRIDPIPE_UNDER_MPIRUN", None)
    env.pop("HYBRIDPIPE_TEST_REPORT_DIR", None)
    env.update(extra or {})
    return env


@dataclasses.dataclass
class EmulatedHosts:
    """``hosts`` network namespaces on one bridge; a context manager (``up`` on enter, ``down`` on exit).

    Args:
        hosts: number of emulated hosts (≥ 1).
        rate: egress rate of every host's link, in tc's units (``"1gbit"``); None: unlimited.
        delay: one-way delay added on every host's link (``"0.2ms"``); None: none.
        name: a short tag for the interfaces and namespaces (default: from the process id).

    Example:
        >>> with EmulatedHosts(2, rate="1gbit") as hosts:
        ...     subprocess.run(hosts.mpirun_command(2, [sys.executable, "train.py"]), check=True)
    """

    hosts: int = 2
    rate: str | None = None
    delay: str | None = None
    name: str = ""
    subnet: str = ""
    namespaces: list[str] = dataclasses.field(default_factory=list)
    addresses: list[str] = dataclasses.field(default_factory=list)
    links: list[str] = dataclasses.field(default_factory=list)  # each host's bridge-side veth
    bridge: str = ""
    agent: str = ""
    _undo: list[tuple[str, ...]] = dataclasses.field(default_factory=list, repr=False)

    @staticmethod
    def check_supported() -> None:
        """Raises EmulatedHostsError naming what is missing (root, ip, unshare)."""
        if os.geteuid() != 0:
            raise EmulatedHostsError("emulated hosts need root (network namespaces, a bridge, veth links): "
                                     "run as root, e.g. with sudo")
        for tool in ("ip", "unshare"):
            if not shutil.which(tool):
                raise EmulatedHostsError(f"emulated hosts need `{tool}` on PATH (Debian: apt-get install "
                                         f"{'iproute2' if tool == 'ip' else 'util-linux'})")

    def up(self) -> EmulatedHosts:
        """Builds the bridge, namespaces and links. On failure everything made so far is removed."""
        if self.hosts < 1:
            raise EmulatedHostsError(f"--hosts must be >= 1 (got {self.hosts})")
        self.check_supported()
        # unique per instance: a namespace just deleted may linger a moment (the kernel destroys it
        # asynchronously), so a second set of hosts in the same process must not reuse its names
        self.name = self.name or f"{os.getpid() % 100_000}{_LETTERS[next(_instances) % len(_LETTERS)]}"
        subnet = _free_subnet() if not self.subnet else ipaddress.IPv4Network(self.subnet)
        self.subnet = str(subnet)
        base = subnet.network_address
        self.bridge = f"hpb{self.name}"
        self.namespaces = [f"hp{self.name}h{i}" for i in range(self.hosts)]
        self.addresses = [str(base + 11 + i) for i in range(self.hosts)]
        self.links = [f"hpv{self.name}{i}" for i in range(self.hosts)]
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._undo.append(("link", "del", self.bridge))
            _ip("addr", "add", f"{base + 1}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for ns, address, link in zip(self.namespaces, self.addresses, self.links):
                _ip("netns", "add", ns)
                self._undo.append(("netns", "del", ns))
                # the host's end has the bridge's name: one interface name that means "the emulated network"
                # both in the launching namespace and on every host (MPICH's -iface takes one name)
                _ip("link", "add", link, "type", "veth", "peer", "name", self.bridge, "netns", ns)
                _ip("link", "set", link, "master", self.bridge, "up")
                _ip("-n", ns, "addr", "add", f"{address}/24", "dev", self.bridge)
                _ip("-n", ns, "link", "set", self.bridge, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
                if self.rate or self.delay:
                    _tc(ns, *_shaping(self.bridge, self.rate, self.delay))
            directory = Path(tempfile.mkdtemp(prefix=f"hybridpipe-hosts-{self.name}-"))
            self._undo.append(("rm", str(directory)))
            agent = directory / "agent"
            cases = "\n".join(f"  {a}|{ns}) ns={ns} ;;" for a, ns in zip(self.addresses, self.namespaces))
            agent.write_text(AGENT.format(cases=cases))
            agent.chmod(0o755)
            self.agent = str(agent)
        except BaseException:
            self.down()
            raise
        return self

    def down(self) -> None:
        """Removes everything ``up`` made (deleting a namespace deletes both ends of its veth) and
        kills the processes still running in its namespaces (deleting one would not end them)."""
        killed = []
        for namespace in self.namespaces:
            pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                    killed.append(int(pid))
                except (ProcessLookupError, ValueError):
                    pass
        # a namespace (and its links) outlives `ip netns del` while a process is inside it
        deadline = time.monotonic() + 10
        while killed and time.monotonic() < deadline:
            killed = [pid for pid in killed if _running(pid)]
            time.sleep(0.05)
        for undo in reversed(self._undo):
            if undo[0] == "rm":
                shutil.rmtree(undo[1], ignore_errors=True)
            else:
                subprocess.run(["ip", *undo], capture_output=True)
        self._undo.clear()
        # the links go with their namespaces, which the kernel destroys in the background: delete what
        # is left and wait, so that the names are free again when this returns
        deadline = time.monotonic() + 10
        for link in self.links:
            while subprocess.run(["ip", "link", "show", link], capture_output=True).returncode == 0:
                subprocess.run(["ip", "link", "del", link], capture_output=True)
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)

    def __enter__(self) -> EmulatedHosts:
        return self.up()

    def __exit__(self, *exc: Any) -> None:
        self.down()

    def cut(self, host: int) -> None:
        """Cuts host ``host``'s link (its bridge-side veth goes down)."""
        _ip("link", "set", self.links[host], "down")

    def mend(self, host: int) -> None:
        """Brings host ``host``'s link back up."""
        _ip("link", "set", self.links[host], "up")

    def mpirun_command(self, ranks_per_host: int | Sequence[int], argv: Sequence[str],
                       env: Mapping[str, str] | None = None, mpirun: str | None = None,
                       extra_args: Sequence[str] = (), round_robin: bool = False) -> list[str]:
        """The launch command for ``ranks_per_host`` ranks on every host (or a list: that many on each
        host, e.g. ``[3, 1]``): packed by host (ranks 0..k-1 on the first), or with ``round_robin``
        rank r on host r mod hosts. ``env`` is added to :func:`forwarded_environment`. Open MPI and
        MPICH."""
        launcher = find_mpirun(mpirun)
        flavour = mpi_flavour(launcher)
        counts = [ranks_per_host] * self.hosts if isinstance(ranks_per_host, int) else list(ranks_per_host)
        if len(counts) != self.hosts or min(counts) < 1:
            raise EmulatedHostsError(f"ranks_per_host={ranks_per_host!r}: give one count >= 1, or one per host "
                                     f"({self.hosts} hosts)")
        if round_robin and len(set(counts)) > 1:
            raise EmulatedHostsError(f"round_robin needs the same number of ranks on every host, not {counts}")
        # MPICH's hydra fills each host's slots in turn and wraps around the list: one slot each is round-robin
        slots = [1] * self.hosts if round_robin and flavour == "mpich" else counts
        hosts = ",".join(f"{address}:{n}" for address, n in zip(self.addresses, slots))
        variables = forwarded_environment(env)
        if flavour == "openmpi":
            variables.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")  # ranks outnumber cores here
            placement = ["--host", hosts, "--map-by", "node" if round_robin else "slot", "--prtemca", "plm_ssh_agent", self.agent,
                         "--prtemca", "oob_tcp_if_include", self.subnet, "--mca", "oob_tcp_if_include",
                         self.subnet, "--mca", "btl_tcp_if_include", self.subnet]
        elif flavour == "mpich":
            placement = ["-hosts", hosts, "-launcher", "ssh", "-launcher-exec", self.agent, "-iface", self.bridge]
        else:
            raise EmulatedHostsError(f"{launcher} is neither Open MPI nor MPICH: cannot launch on emulated hosts")
        return mpirun_command(sum(counts), argv, mpirun=launcher,
                              extra_args=[*placement, *extra_args], env=variables, oversubscribe=False,
                              fault_tolerant=True)

    def save(self) -> Path:
        """Writes this set of hosts to STATE_DIR/NAME.json (for ``down --name`` from another process)."""
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        path = STATE_DIR / f"{self.name}.json"
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "_undo"}
        path.write_text(json.dumps({**fields, "undo": self._undo}, indent=1))
        return path

    @classmethod
    def load(cls, name: str) -> EmulatedHosts:
        path = STATE_DIR / f"{name}.json"
        if not path.exists():
            known = sorted(p.stem for p in STATE_DIR.glob("*.json")) if STATE_DIR.exists() else []
            raise EmulatedHostsError(f"no emulated hosts named {name!r} (known: {known or 'none'})")
        data = json.loads(path.read_text())
        undo = [tuple(item) for item in data.pop("undo")]
        hosts = cls(**data)
        hosts._undo = undo
        return hosts


_instances = itertools.count()
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _running(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie (a zombie holds no namespace)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[-1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


# ---------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hybridpipe.testing.emulated_hosts",
                                     description="Run an MPI job across emulated hosts (network namespaces).")
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "up"):
        sub = commands.add_parser(name)
        sub.add_argument("--hosts", type=int, default=2, help="number of emulated hosts (default 2)")
        sub.add_argument("--rate", help="link rate per host, tc units, e.g. 1gbit")
        sub.add_argument("--delay", help="one-way link delay, e.g. 0.2ms")
        sub.add_argument("--name", default="", help="tag for the namespaces (default: from the pid)")
        if name == "run":
            sub.add_argument("--ranks-per-host", type=int, default=1)
            sub.add_argument("--mpi", choices=["openmpi", "mpich"], help="which MPI's mpirun to use (default: "
                             "$HYBRIDPIPE_MPIRUN, the one beside this Python, then PATH)")
            sub.add_argument("--mpirun", help="path of the mpirun to use")
            sub.add_argument("-x", "--env", action="append", default=[], metavar="NAME=VALUE")
            sub.add_argument("program", nargs=argparse.REMAINDER)
    down = commands.add_parser("down")
    down.add_argument("--name", help="the set to remove (default: every set `up` recorded)")
    return parser


def _launcher_for(mpi: str | None, mpirun: str | None) -> str | None:
    if mpirun or not mpi:
        return mpirun
    candidates = [os.environ.get("HYBRIDPIPE_MPIRUN"), str(Path(sys.executable).parent / "mpirun"),
                  shutil.which("mpirun"), shutil.which("mpiexec")]
    for candidate in candidates:
        if candidate and os.access(candidate, os.X_OK) and mpi_flavour(candidate) == mpi:
            return candidate
    raise EmulatedHostsError(f"no {mpi} mpirun found (looked at $HYBRIDPIPE_MPIRUN, beside {sys.executable}, "
                             f"and PATH): pass --mpirun PATH")


def _run(args: argparse.Namespace) -> int:
    program = args.program[1:] if args.program[:1] == ["--"] else args.program
    if not program:
        raise EmulatedHostsError("give the program after --, e.g. `-- python train.py`")
    if args.ranks_per_host < 1:
        raise EmulatedHostsError(f"--ranks-per-host must be >= 1 (got {args.ranks_per_host})")
    env = {}
    for item in args.env:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise EmulatedHostsError(f"-x/--env takes NAME=VALUE (got {item!r})")
        env[key] = value
    launcher = _launcher_for(args.mpi, args.mpirun)
    stop = {"signal": 0}

    def on_signal(signum: int, _frame: Any) -> None:
        stop["signal"] = signum
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    hosts = EmulatedHosts(args.hosts, rate=args.rate, delay=args.delay, name=args.name)
    process = None
    try:
        hosts.up()
        command = hosts.mpirun_command(args.ranks_per_host, program, env=env, mpirun=launcher)
        print(f"emulated hosts: {', '.join(f'{ns} at {a}' for ns, a in zip(hosts.namespaces, hosts.addresses))}"
              f"{f', rate {args.rate}' if args.rate else ''}{f', delay {args.delay}' if args.delay else ''}",
              file=sys.stderr, flush=True)
        process = subprocess.Popen(command, start_new_session=True)
        code = process.wait()
        return 128 - code if code < 0 else code
    except KeyboardInterrupt:
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        return 128 + (stop["signal"] or signal.SIGINT)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        hosts.down()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "run":
            return _run(args)
        if args.command == "up":
            hosts = EmulatedHosts(args.hosts, rate=args.rate, delay=args.delay, name=args.name).up()
            path = hosts.save()
            print(f"emulated hosts {hosts.name!r} up ({path}): "
                  + ", ".join(f"{ns} at {a}" for ns, a in zip(hosts.namespaces, hosts.addresses)))
            print("launch with:", shlex.join(hosts.mpirun_command(1, ["python", "script.py"])))
            print(f"remove with: python -m hybridpipe.testing.emulated_hosts down --name {hosts.name}")
            return 0
        names = [args.name] if args.name else sorted(p.stem for p in STATE_DIR.glob("*.json")) \
            if STATE_DIR.exists() else []
        for name in names:
            EmulatedHosts.load(name).down()
            (STATE_DIR / f"{name}.json").unlink()
            print(f"emulated hosts {name!r} removed")
        return 0
    except EmulatedHostsError as error:
        print(f"emulated_hosts: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
