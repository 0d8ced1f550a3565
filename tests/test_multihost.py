"""Several hosts on one machine: network namespaces joined by a bridge, one per emulated host.

mpirun reaches each "host" through a stand-in for ssh that runs the daemon's command inside that
host's namespace (with its own hostname), so Open MPI sees separate nodes: ranks of different
hosts talk over TCP, and MPI_Comm_split_type(MPI_COMM_TYPE_SHARED) groups the ranks per host, as
on a cluster. Needs root and iproute2's `ip netns`; skipped (with the reason) where either is missing.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hybridpipe.launch import mpirun_command

ROOT = Path(__file__).resolve().parents[1]

AGENT = """#!/bin/sh
# ssh stand-in: AGENT [options] HOST COMMAND... runs COMMAND in HOST's network namespace
while [ "${{1#-}}" != "$1" ]; do shift; done
host="$1"; shift
case "$host" in
{cases}
  *) echo "emulated-hosts agent: unknown host $host" >&2; exit 255 ;;
esac
exec ip netns exec "$ns" unshare --uts /bin/sh -c "hostname $ns; $*"
"""


@dataclasses.dataclass
class Hosts:
    addresses: list[str]
    subnet: str
    agent: Path

    def mpirun(self, ranks_per_host: int, argv: list[str], env: dict[str, str]) -> list[str]:
        hosts = ",".join(f"{address}:{ranks_per_host}" for address in self.addresses)
        extra = ["--host", hosts, "--prtemca", "plm_ssh_agent", str(self.agent),
                 "--prtemca", "oob_tcp_if_include", self.subnet, "--mca", "oob_tcp_if_include", self.subnet,
                 "--mca", "btl_tcp_if_include", self.subnet, "-x", "PATH"]
        return mpirun_command(ranks_per_host * len(self.addresses), argv, extra_args=extra, env=env,
                              oversubscribe=False)


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {result.stderr.strip()}")


@pytest.fixture(scope="module")
def emulated_hosts(tmp_path_factory) -> Hosts:
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        pytest.skip("emulated hosts need root, iproute2 (ip netns) and unshare")
    tag = os.getpid() % 100_000
    octet = 100 + os.getpid() % 100
    bridge, namespaces = f"hpb{tag}", [f"hp{tag}h{i}" for i in (1, 2)]
    subnet = f"10.77.{octet}.0/24"
    addresses = [f"10.77.{octet}.{11 + i}" for i in range(len(namespaces))]
    made: list[tuple[str, ...]] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        made.append(("link", "del", bridge))
        _ip("addr", "add", f"10.77.{octet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        for i, (ns, address) in enumerate(zip(namespaces, addresses)):
            _ip("netns", "add", ns)
            made.append(("netns", "del", ns))
            veth = f"hpv{tag}{i}"
            _ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", veth, "master", bridge, "up")
            _ip("-n", ns, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except RuntimeError as error:
        for undo in reversed(made):
            subprocess.run(["ip", *undo], capture_output=True)
        pytest.skip(f"cannot build emulated hosts here: {error}")
    agent = tmp_path_factory.mktemp("hosts") / "agent"
    cases = "\n".join(f"  {address}) ns={ns} ;;" for address, ns in zip(addresses, namespaces))
    agent.write_text(AGENT.format(cases=cases))
    agent.chmod(0o755)
    yield Hosts(addresses, subnet, agent)
    for undo in reversed(made):  # deleting a namespace deletes its end of the veth pair, and so both
        subprocess.run(["ip", *undo], capture_output=True)


def test_shared_memory_serves_only_the_groups_inside_one_host(emulated_hosts):
    """2 hosts × 2 ranks, 2 stages: world spans both hosts (ring over TCP); the data or pipe
    groups that stay inside one host use the shared-memory allreduce; all reduce correctly."""
    command = emulated_hosts.mpirun(2, [sys.executable, str(ROOT / "tests" / "multihost" / "worker.py")],
                                    env={"OMP_NUM_THREADS": "1", "OMPI_MCA_mpi_yield_when_idle": "1"})
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=150)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    for rank in range(4):
        assert f"rank {rank} ok" in output, output
