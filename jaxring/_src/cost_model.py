"""An alpha-beta-gamma cost model of jaxring's plans.

Each tier of a machine has a latency alpha (seconds per message), an inverse
bandwidth beta (seconds per byte on one of its links) and a count of ranks
whose traffic on that tier shares one link (``shared_by``: 1 where every
rank has its own link, e.g. one NIC per GPU; 8 where 8 GPUs of a host share
one NIC). Reductions cost gamma seconds per byte reduced.

A phase of a plan is a ring of g ranks over a shard of S bytes, split into K
rings (parts) and pipelined in chunks of at most C bytes. It runs `steps`
steps (g-1 for a reduce-scatter or an all-gather, 2(g-1) for an allreduce),
and its time is

    (steps + m - 1) * alpha         m = chunks per segment, ceil(S/(g K C)):
                                    a message latency per step on the critical
                                    path, plus pipeline fill
  + steps * S/(g K) * streams * beta   every stream on the busiest link
                                    carries steps segments of its ring
  + reduce_steps * S/g * gamma      the rank's reduction work

where ``streams`` is how many ring streams leave through one link: K rings
of each rank sharing the link. A flat ring over several tiers runs at the
pace of its slowest hop, on the loosest tier; there the K rings cross
between groups at K different ranks, whose link they share when
``shared_by`` > 1 (odd rings cross at a group's first rank, even ones at its
last, so with a link per rank half of them meet).

The exchange (recursive doubling, tiered_plan.h's exchange shape) is a
sequence of such phases on the whole buffer: one exchange step per factor 2
of the world size, with partners 1, 2, 4, ... ranks apart, each sending the
whole part of each ring once, then a ring allreduce over the odd rest. Each
step runs on the loosest tier its partners straddle.

The model's byte counts come from the plans themselves (TieredPlan's shards
and phases), so it predicts the schedule jaxring runs. It ignores
contention between tiers (a tier's phases run one after another) and CPU
work besides the reduction.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence


@dataclasses.dataclass(frozen=True)
class Tier:
    size: int  # ranks in each group of this tier
    alpha_s: float  # latency of one message
    beta_s_per_byte: float  # inverse bandwidth of one link
    shared_by: int = 1  # ranks whose traffic on this tier shares a link

    def __post_init__(self):
        if self.size < 1 or self.shared_by < 1:
            raise ValueError(f"a tier needs size and shared_by >= 1: {self}")
        if self.alpha_s < 0 or self.beta_s_per_byte < 0:
            raise ValueError(f"a tier's alpha and beta must not be negative: {self}")


@dataclasses.dataclass(frozen=True)
class Machine:
    tiers: tuple[Tier, ...]  # tightest first
    gamma_s_per_byte: float = 0.0  # reduction cost per byte reduced

    @property
    def world_size(self) -> int:
        return math.prod(t.size for t in self.tiers)

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(t.size for t in self.tiers)


def phase_time(
    g: int,
    shard_bytes: float,
    steps: int,
    reduce_steps: int,
    rings: int,
    chunk_bytes: int,
    tier: Tier,
    streams: int,
    gamma: float,
) -> float:
    """Seconds one phase takes (see the module docstring)."""
    if g <= 1 or steps == 0:
        return 0.0
    segment = shard_bytes / (g * rings)
    chunks = max(1, math.ceil(segment / max(chunk_bytes, 1)))
    return (
        (steps + chunks - 1) * tier.alpha_s
        + steps * segment * streams * tier.beta_s_per_byte
        + reduce_steps * shard_bytes / g * gamma
    )


def flat_ring_time(machine: Machine, nbytes: float, rings: int, chunk_bytes: int) -> float:
    """One flat ring over every rank, at the pace of its slowest hop."""
    p = machine.world_size
    active = [t for t in machine.tiers if t.size > 1]
    if p <= 1:
        return 0.0
    loosest = active[-1]
    if len(active) == 1:
        streams = rings  # every ring leaves each rank
    elif loosest.shared_by > 1:
        streams = rings  # all crossings share the link
    else:
        streams = math.ceil(rings / 2)  # even and odd rings cross apart
    return phase_time(
        p,
        nbytes,
        2 * (p - 1),
        p - 1,
        rings,
        chunk_bytes,
        loosest,
        streams,
        machine.gamma_s_per_byte,
    )


def tiered_phases(dims: Sequence[int]) -> list[tuple[str, int]]:
    """(kind, tier) of each phase of the tiered plan, as in tiered_plan.h."""
    active = [i for i, d in enumerate(dims) if d > 1]
    if not active:
        return []
    return (
        [("reduce_scatter", i) for i in active[:-1]]
        + [("allreduce", active[-1])]
        + [("all_gather", i) for i in reversed(active[:-1])]
    )


def tiered_time(machine: Machine, nbytes: float, rings: int, chunk_bytes: int) -> float:
    """The tiered plan over the machine's tiers: phase after phase."""
    total, shard = 0.0, float(nbytes)
    shards = {}
    for kind, i in tiered_phases(machine.dims):
        tier = machine.tiers[i]
        g = tier.size
        if kind == "all_gather":
            shard = shards[i]
        shards.setdefault(i, shard)
        steps = 2 * (g - 1) if kind == "allreduce" else g - 1
        reduce_steps = 0 if kind == "all_gather" else g - 1
        total += phase_time(
            g,
            shard,
            steps,
            reduce_steps,
            rings,
            chunk_bytes,
            tier,
            rings * tier.shared_by,
            machine.gamma_s_per_byte,
        )
        if kind == "reduce_scatter":
            shard = shard / g
    return total


def exchange_tiers(p: int) -> list[int]:
    """The exchange's steps for p ranks, as tiered_plan.cc's exchange_tiers:
    a 2 per factor 2 of p, then the odd rest if it is more than 1."""
    dims = []
    while p > 1 and p % 2 == 0:
        dims.append(2)
        p //= 2
    if p > 1 or not dims:
        dims.append(p)
    return dims


def tier_at_stride(machine: Machine, stride: int) -> Tier:
    """The tier that ranks `stride` apart meet on: ranks are numbered
    tightest tier first, so it is the loosest tier whose groups are at most
    `stride` ranks apart."""
    tier, span = machine.tiers[0], 1
    for t in machine.tiers:
        if span > stride:
            break
        if t.size > 1:
            tier = t
        span *= t.size
    return tier


def exchange_time(machine: Machine, nbytes: float, rings: int, chunk_bytes: int) -> float:
    """The exchange (recursive doubling) over the machine's ranks."""
    total, stride = 0.0, 1
    for g in exchange_tiers(machine.world_size):
        tier = tier_at_stride(machine, stride)
        streams = rings * tier.shared_by
        if g == 2:
            # One step that sends and reduces the whole buffer: a phase of
            # a 2-rank ring over a shard of 2n, whose segment is n per ring.
            total += phase_time(
                2, 2 * nbytes, 1, 1, rings, chunk_bytes, tier, streams, machine.gamma_s_per_byte
            )
        elif g > 1:
            total += phase_time(
                g,
                nbytes,
                2 * (g - 1),
                g - 1,
                rings,
                chunk_bytes,
                tier,
                streams,
                machine.gamma_s_per_byte,
            )
        stride *= g
    return total


def emulated_machine(links: Sequence[tuple[int, float, float]], world: int) -> Machine | None:
    """The machine that cpu_link emulates for an operation of `world` ranks:
    links as config.parse_links gives them, (size, bytes/s, latency s) per
    tier, tightest first, the last of size 0 (the rest of the ranks). A
    tier's link belongs to a group of the tier below, so every rank of that
    group shares it (link_pacing.h). None where the tiers do not divide the
    world."""
    inner = math.prod(size for size, _, _ in links[:-1])
    if not links or world < 1 or world % inner:
        return None
    tiers, below = [], 1
    for i, (size, rate, latency) in enumerate(links):
        size = size if i + 1 < len(links) else world // inner
        tiers.append(Tier(size, latency, 1.0 / rate, shared_by=below))
        below *= size
    return Machine(tuple(tiers))


def tier_bytes(machine: Machine, nbytes: float) -> list[float]:
    """Bytes one rank sends on each tier under the tiered plan:
    2(d_i - 1)/d_i * n / (d_0 ... d_(i-1))."""
    out, tighter = [], 1
    for t in machine.tiers:
        out.append(2 * (t.size - 1) / t.size * nbytes / tighter)
        tighter *= t.size
    return out
