"""How many cores each rank of a job has, and the ring count that follows.

A ring's transfers are work for the cores of the processes at its ends:
copying into the link, reducing what arrives, in threads of their own. The
default of two rings runs a second beside the first, the other way round, so
that both directions of each link carry data. Where ranks share cores (more
processes on a machine than it has cores to give them, as on a laptop or a
small CI machine), a second ring's threads only take turns with the first's
on the same cores, and every turn costs a switch and the caches: on a 2-core
machine one ring was faster than two, or as fast, in every layout measured
(docs/benchmarking.md, "Rings on a crowded machine").

So an allreduce across processes whose ring count was left to the default
takes one ring where some machine of the job has fewer than CROWDED_BELOW
cores per rank. The rule reads only what every process published (the same
records, so every process makes the same choice: ranks that disagreed on the
ring count would fail with a mismatch error); a record without the fields
(which no current process writes) counts as a machine with cores to spare.
"""

from __future__ import annotations

import math
import os
import re
import socket
from collections.abc import Iterable

CROWDED_BELOW = 2.0
# Linux's own limit on CPU numbers (NR_CPUS) is at most 8192: a record that
# names more is not one a process wrote.
MAX_CPUS = 8192
_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def machine_identity() -> str:
    """What processes that share cores have in common: the running kernel
    (its boot id). Unlike distributed.host_identity it ignores
    JAXRING_HOST_ID: emulated hosts still share the machine's cores."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def cpu_ranges(cpus: Iterable[int]) -> str:
    """CPU numbers as taskset writes them ("0-3,8"): a record stays short
    however many cores the machine has (every process reads every record)."""
    out: list[str] = []
    run: list[int] = []
    for c in sorted(set(cpus)):
        if run and c == run[-1] + 1:
            run[-1] = c
            continue
        if run:
            out.append(str(run[0]) if run[0] == run[1] else f"{run[0]}-{run[1]}")
        run = [c, c]
    if run:
        out.append(str(run[0]) if run[0] == run[1] else f"{run[0]}-{run[1]}")
    return ",".join(out)


def parse_cpu_ranges(text) -> set | None:
    """The CPUs cpu_ranges wrote, or None for anything else (numbers past
    MAX_CPUS, reversed ranges, other characters)."""
    if not isinstance(text, str) or not text or len(text) > 8 * MAX_CPUS:
        return None
    cpus: set = set()
    for part in text.split(","):
        m = _RANGE.fullmatch(part)
        if not m:
            return None
        lo = int(m.group(1))
        hi = lo if m.group(2) is None else int(m.group(2))
        if not lo <= hi < MAX_CPUS:
            return None
        cpus.update(range(lo, hi + 1))
    return cpus


def local_record(local_ranks: int) -> dict:
    """This process's part of the table: its machine, the CPUs it may run on,
    and how many ranks (devices) it runs."""
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        cpus = range(os.cpu_count() or 1)
    return {"machine": machine_identity(), "cpus": cpu_ranges(cpus), "ranks": int(local_ranks)}


def cores_per_rank(records: Iterable[dict]) -> float:
    """The fewest cores per rank over the job's machines: on each machine, the
    CPUs any of its processes may run on, over the ranks they run. inf when
    a record lacks the fields (or holds values of the wrong kind)."""
    cpus: dict[str, set] = {}
    ranks: dict[str, int] = {}
    for record in records:
        machine = record.get("machine")
        mine = parse_cpu_ranges(record.get("cpus"))
        n = record.get("ranks")
        if (
            not isinstance(machine, str)
            or mine is None
            or not isinstance(n, int)
            or isinstance(n, bool)
            or n < 1
        ):
            return math.inf
        cpus.setdefault(machine, set()).update(mine)
        ranks[machine] = ranks.get(machine, 0) + n
    if not ranks:
        return math.inf
    return min(len(cpus[m]) / ranks[m] for m in ranks)


def rings_for(configured: int, cores: float) -> int:
    """The ring count of an allreduce across processes whose count was left
    to the default `configured`, on a job with `cores` cores per rank."""
    return 1 if cores < CROWDED_BELOW else configured
