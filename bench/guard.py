"""Run a benchmark on an idle machine and say afterwards whether anything else ran beside it.

Usage:
    python bench/guard.py [--idle-percent 10] [--idle-samples 2] [--wait-seconds 300] [--foreign-limit 10] \
        -- COMMAND [ARGUMENTS ...]

1. It samples the machine's busy share of its CPUs once a second (``/proc/stat``) until ``--idle-samples``
   samples in a row are below ``--idle-percent``, for at most ``--wait-seconds`` (then it says so and runs anyway).
2. It runs the command, keeping its exit status.
3. It compares the CPU time the whole machine spent busy during the run with the CPU time the command and its
   children used (``getrusage``): the rest is foreign load. A run where it exceeds ``--foreign-limit`` per cent of
   the machine's capacity over the run's wall time is reported ``DISTURBED`` on standard error, else ``clean``.

Benchmarks measure ratios within one run, so a disturbed run's ratios may still hold; its absolute times do not.
Linux only (it reads ``/proc/stat``).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass

__all__ = ["Verdict", "busy_seconds", "busy_share", "guarded", "wait_for_idle"]


def _ticks() -> tuple[int, int]:
    """The machine's total and idle (idle + iowait) CPU ticks since boot."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    return sum(fields), fields[3] + fields[4]


def busy_seconds() -> float:
    """CPU seconds the whole machine has spent busy since boot (every CPU together)."""
    total, idle = _ticks()
    return (total - idle) / os.sysconf("SC_CLK_TCK")


def busy_share(interval: float = 1.0) -> float:
    """The machine's busy share of its CPUs over the next ``interval`` seconds, in per cent."""
    total, idle = _ticks()
    time.sleep(interval)
    total_after, idle_after = _ticks()
    return 100.0 * (1.0 - (idle_after - idle) / max(1, total_after - total))


def wait_for_idle(idle_percent: float, samples: int, wait_seconds: float) -> tuple[bool, float]:
    """Waits until ``samples`` one-second samples in a row are below ``idle_percent``; ``(idle, last share)``."""
    deadline = time.monotonic() + wait_seconds
    quiet, share = 0, 0.0
    while time.monotonic() < deadline:
        share = busy_share()
        quiet = quiet + 1 if share < idle_percent else 0
        if quiet >= samples:
            return True, share
    return False, share


@dataclass
class Verdict:
    """What ran beside a command: its wall time, its own CPU seconds, the machine's, and the foreign share."""

    returncode: int
    wall_seconds: float
    own_cpu_seconds: float
    machine_cpu_seconds: float
    foreign_limit: float

    @property
    def foreign_share(self) -> float:
        """Foreign CPU time over the machine's capacity during the run (0 to 1)."""
        foreign = self.machine_cpu_seconds - self.own_cpu_seconds
        return max(0.0, foreign) / max(1e-9, self.wall_seconds * (os.cpu_count() or 1))

    @property
    def disturbed(self) -> bool:
        return self.foreign_share > self.foreign_limit / 100

    def line(self) -> str:
        return (f"[guard] wall {self.wall_seconds:.1f} s, the command {self.own_cpu_seconds:.1f} CPU-s, the machine "
                f"{self.machine_cpu_seconds:.1f} CPU-s busy: foreign share {self.foreign_share:.0%} -> "
                f"{'DISTURBED' if self.disturbed else 'clean'}")


def guarded(command: list[str], foreign_limit: float = 10.0) -> Verdict:
    """Runs ``command`` and measures the foreign load beside it."""
    before_children = resource.getrusage(resource.RUSAGE_CHILDREN)
    machine, started = busy_seconds(), time.monotonic()
    returncode = subprocess.call(command)
    wall, machine = time.monotonic() - started, busy_seconds() - machine
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    own = (after.ru_utime - before_children.ru_utime) + (after.ru_stime - before_children.ru_stime)
    return Verdict(returncode, wall, own, machine, foreign_limit)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--idle-percent", type=float, default=10.0, help="busy share counted as idle (default 10)")
    parser.add_argument("--idle-samples", type=int, default=2, help="idle one-second samples in a row (default 2)")
    parser.add_argument("--wait-seconds", type=float, default=300.0, help="longest wait for idle (default 300)")
    parser.add_argument("--foreign-limit", type=float, default=10.0,
                        help="foreign per cent of the machine beyond which the run is DISTURBED (default 10)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGUMENTS ...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command to run after --, e.g. python bench/guard.py -- python bench/allreduce.py")
    idle, share = wait_for_idle(args.idle_percent, args.idle_samples, args.wait_seconds)
    if not idle:
        print(f"[guard] the machine was not idle within {args.wait_seconds:g} s (last {share:.0f} % busy); "
              "running anyway", file=sys.stderr)
    verdict = guarded(command, args.foreign_limit)
    print(verdict.line(), file=sys.stderr)
    return verdict.returncode


if __name__ == "__main__":
    sys.exit(main())
