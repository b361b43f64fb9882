"""Which tiers an allreduce's ranks form, for the tiered plan.

A topology is a tuple of tier sizes, tightest first: ``(4, 2, 8)`` is 4
devices per process, 2 processes per host, 8 hosts. Rank r then has the
coordinates ``r % 4``, ``r // 4 % 2`` and ``r // 8``, and the tiered plan
(``xla_ffi/tiered_plan.h``) reduce-scatters inside each tier before it crosses
the next, so a loose tier carries 1 / (product of the tighter tiers) of what
a flat ring would send over it. The empty tuple is one flat ring.

The setting (``jaxring.config.topology``, ``JAXRING_TOPOLOGY``, or the
``topology=`` argument) is ``"auto"``, ``"flat"`` or a tuple. ``"auto"``
derives the tiers from where the ranks run: the devices of one process, the
processes that share a host address (as published for the TCP transport),
then hosts. It takes a tiered plan only where the ranks fall in regular
blocks (each process holds the same number of consecutive ranks, each host
the same number of consecutive processes); otherwise a flat ring.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

# The TCP frame header packs the tiers into one 64-bit word (frames.h).
MAX_TIERS = 4
MAX_TIER_SIZE = 0xFFFF


def parse(text: str) -> Any:
    """``"auto"``, ``"flat"``, or ``"2x4"`` -> ``(2, 4)``."""
    t = text.strip()
    if t in ("auto", "flat"):
        return t
    return tuple(int(p) for p in t.lower().split("x"))


def is_setting(value: Any) -> bool:
    if value in ("auto", "flat"):
        return True
    return (
        isinstance(value, tuple)
        and 1 <= len(value) <= MAX_TIERS
        and all(
            isinstance(d, int) and not isinstance(d, bool) and 1 <= d <= MAX_TIER_SIZE
            for d in value
        )
    )


REQUIREMENT = (
    f'"auto", "flat" or a tuple of 1 to {MAX_TIERS} tier sizes '
    f"(1 to {MAX_TIER_SIZE} each), tightest first"
)


def normalized(dims: tuple) -> tuple:
    """dims without its tiers of one rank (the plan skips them), or () when
    at most one tier is left: that plan is exactly the flat ring, whose HLO
    then stays what it was."""
    kept = tuple(d for d in dims if d > 1)
    return kept if len(kept) > 1 else ()


def _blocks(keys: list) -> int | None:
    """Length of the runs of equal consecutive keys, if every run has the
    same length and no key comes back after its run ended."""
    runs, seen, prev = [], set(), object()
    for k in keys:
        if k != prev:
            if k in seen:
                return None
            seen.add(k)
            runs.append(0)
            prev = k
        runs[-1] += 1
    return runs[0] if runs and all(r == runs[0] for r in runs) else None


def discover(processes: np.ndarray, hosts: dict[int, str] | None) -> tuple:
    """The tiers of one ring from the process of each of its ranks (and the
    host of each process): (ranks per process, processes per host, hosts),
    or () when the ranks do not fall in regular blocks."""
    procs = [int(p) for p in processes]
    per_process = _blocks(procs)
    if per_process is None:
        return ()
    order = procs[::per_process]  # the processes, in rank order
    host_of = [hosts.get(p, str(p)) if hosts else str(p) for p in order]
    per_host = _blocks(host_of)
    if per_host is None:
        return (per_process, len(order))
    return (per_process, per_host, len(order) // per_host)


def spans_processes(rank_process: np.ndarray) -> bool:
    """Whether the ranks of a table (rank_process[r]: the process running
    rank r) run in more than one process."""
    return bool(len(rank_process)) and bool((rank_process != rank_process[0]).any())


def resolve(
    setting: Any,
    world: int,
    rank_process: np.ndarray,
    hosts: dict[int, str] | None = None,
    where: str = "jaxring.allreduce",
) -> tuple:
    """The tiers an operation's custom call carries (empty: a flat ring).
    hosts: the host of each process (distributed.process_hosts()); without
    it, each process counts as a host of its own."""
    across = spans_processes(rank_process)
    if setting == "flat" or world <= 1:
        return ()
    if setting == "auto":
        if not across:
            return ()
        rows = np.asarray(rank_process).reshape(-1, world)
        found = {discover(row, hosts) for row in rows}
        # One attribute serves every group of the lowering, so the groups
        # must agree; they do on any regular mesh.
        dims = found.pop() if len(found) == 1 else ()
        if dims and math.prod(dims) != world:
            return ()
        return normalized(dims)
    dims = tuple(setting)
    if math.prod(dims) != world:
        raise ValueError(
            f"{where}: topology {dims} has {math.prod(dims)} ranks but the "
            f"allreduce runs over {world}; the tier sizes must multiply to the "
            "size of the reduced axes."
        )
    return normalized(dims)
