"""How many cores each rank of a job has, and the ring count that follows.

A ring's transfers are work for the cores of the processes at its ends:
copying into the link, reducing what arrives, in threads of their own. Where
every rank has at least a couple of cores, a second ring runs beside the first
and keeps both directions of each link busy. Where ranks share cores (more
processes on a machine than it has cores to give them, as on a laptop or a
small CI machine), a second ring's threads only take turns with the first's
on the same cores, and every turn costs a switch and the caches: on a 2-core
machine, one ring moved 1-4 MiB 1.2-1.3x faster than two, with 2 and with 4
processes (docs/benchmarking.md, "Rings on a crowded machine").

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
import socket
from typing import Iterable

CROWDED_BELOW = 2.0


def machine_identity() -> str:
    """What processes that share cores have in common: the running kernel
    (its boot id). Unlike distributed.host_identity it ignores
    JAXRING_HOST_ID: emulated hosts still share the machine's cores."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def local_record(local_ranks: int) -> dict:
    """This process's part of the table: its machine, the CPUs it may run on,
    and how many ranks (devices) it runs."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = list(range(os.cpu_count() or 1))
    return {"machine": machine_identity(), "cpus": cpus, "ranks": int(local_ranks)}


def cores_per_rank(records: Iterable[dict]) -> float:
    """The fewest cores per rank over the job's machines: on each machine, the
    CPUs any of its processes may run on, over the ranks they run. inf when
    a record lacks the fields (or holds values of the wrong kind)."""
    cpus: dict[str, set] = {}
    ranks: dict[str, int] = {}
    for record in records:
        machine = record.get("machine")
        mine = record.get("cpus")
        n = record.get("ranks")
        if (not isinstance(machine, str) or not isinstance(mine, list)
                or not all(isinstance(c, int) for c in mine)
                or not isinstance(n, int) or isinstance(n, bool) or n < 1):
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
