"""Bucket planning for jaxring.overlap: pure, no JAX.

The program is a sequence of equations; a *slot* s is the point just before
equation s (slot n is the end). Each reduced value is an :class:`Item` that
can be started from slot ``ready`` (its producer has run) and must be done by
slot ``needed`` (its first use). The planner

1. cuts items bigger than the partition size into parts (ByteScheduler), so
   that one huge tensor does not hold back the rest;
2. groups items in the order they become ready (the backward pass produces
   the last layers' gradients first) into buckets: the first bucket closes at
   ``first_bucket_bytes`` so that communication starts early (PyTorch DDP),
   the others at ``bucket_bytes``; a bucket also closes when the next item
   only becomes ready after some item already in it is needed (a BatchNorm
   statistic must not wait for gradients);
3. applies a credit window: before a bucket starts, the oldest buckets still
   in flight are finished until the bytes in flight fit ``max_inflight_bytes``;
4. returns, per slot, the ordered list of actions ("start" or "done",
   bucket) to emit there.

Each bucket starts at the slot where its last item becomes ready and is done
at the slot where its first item is needed (or earlier, for the window).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Item:
    """One value to reduce, or a contiguous part of one."""

    key: Hashable  # identifies the value (the planner does not look)
    nbytes: int
    dtype: Any  # items of different dtypes may share a bucket
    ready: int  # first slot at which it can start
    needed: int  # last slot by which it must be done
    part: int = 0  # index of this part within its value
    offset: int = 0  # first element of this part
    count: int = -1  # elements in this part (-1: the whole value)


@dataclasses.dataclass
class Bucket:
    index: int
    items: list[Item]
    start_slot: int
    done_slot: int
    # Buckets the credit window finishes right before this one starts.
    waits_for: list[int] = dataclasses.field(default_factory=list)
    # Buckets whose dones must precede this start for the credit window:
    # waits_for, and those whose done already comes earlier in the program.
    # The start takes their results as dependencies.
    depends_on: list[int] = dataclasses.field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(i.nbytes for i in self.items)


@dataclasses.dataclass
class Plan:
    buckets: list[Bucket]
    # slot -> ordered actions [("start" | "done", bucket index), ...]
    actions: dict[int, list[tuple[str, int]]]


def split_item(item: Item, elem_bytes: int, partition_bytes: int) -> list[Item]:
    """Cuts an item into parts of at most partition_bytes (whole elements)."""
    count = item.nbytes // elem_bytes if elem_bytes else 0
    if partition_bytes <= 0 or item.nbytes <= partition_bytes or count <= 1:
        return [dataclasses.replace(item, count=count)]
    per_part = max(1, partition_bytes // elem_bytes)
    parts = []
    for p, off in enumerate(range(0, count, per_part)):
        n = min(per_part, count - off)
        parts.append(dataclasses.replace(item, nbytes=n * elem_bytes, part=p, offset=off, count=n))
    return parts


def plan_buckets(
    items: list[Item], *, first_bucket_bytes: int, bucket_bytes: int, max_inflight_bytes: int | None
) -> Plan:
    for it in items:
        if it.ready > it.needed:
            raise ValueError(
                f"item {it.key}: ready at slot {it.ready} but needed at slot {it.needed}"
            )
    order = sorted(range(len(items)), key=lambda i: (items[i].ready, i))
    buckets: list[Bucket] = []
    current: list[Item] = []
    start = done = 0

    def close():
        buckets.append(Bucket(len(buckets), list(current), start, done))
        current.clear()

    for i in order:
        it = items[i]
        if current and it.ready > done:
            close()
        if not current:
            start, done = it.ready, it.needed
        current.append(it)
        start = max(start, it.ready)
        done = min(done, it.needed)
        # The first bucket is the smaller of the two caps.
        cap = min(first_bucket_bytes, bucket_bytes) if not buckets else bucket_bytes
        if sum(x.nbytes for x in current) >= cap:
            close()
    if current:
        close()

    _apply_credit_window(buckets, max_inflight_bytes)
    return Plan(buckets, _actions(buckets))


def _apply_credit_window(buckets: list[Bucket], limit: int | None) -> None:
    """Before each start, finishes the oldest buckets until the bytes in
    flight fit the limit.

    The executor runs by dataflow, not in program order: a bucket whose done
    comes earlier in the program may not have finished when a later start
    runs, unless that start depends on its results. So every bucket counts
    as in flight until a start takes it as a dependency; one whose done comes
    later than the start is moved before it (waits_for)."""
    if limit is None:
        return
    in_flight: list[Bucket] = []  # oldest first
    retired: list[int] = []  # taken out of flight, for all later starts
    for b in buckets:  # buckets are in start order
        while in_flight and sum(o.nbytes for o in in_flight) + b.nbytes > limit:
            oldest = in_flight.pop(0)
            done_after_start = oldest.done_slot > b.start_slot or (
                oldest.done_slot == b.start_slot and oldest.start_slot == b.start_slot
            )
            if done_after_start:
                oldest.done_slot = b.start_slot
                b.waits_for.append(oldest.index)
            retired.append(oldest.index)
        # Starts are not ordered among themselves, so each depends on every
        # bucket retired so far, not only on those it retired.
        b.depends_on = list(retired)
        in_flight.append(b)


def _actions(buckets: list[Bucket]) -> dict[int, list[tuple[str, int]]]:
    """Orders each slot: dones of earlier starts, then each start preceded by
    the dones the window forces, then dones of buckets started in the slot."""
    forced = {w for b in buckets for w in b.waits_for}
    actions: dict[int, list[tuple[str, int]]] = {}
    slots = sorted({b.start_slot for b in buckets} | {b.done_slot for b in buckets})
    for s in slots:
        acts = [
            ("done", b.index)
            for b in buckets
            if b.done_slot == s and b.start_slot < s and b.index not in forced
        ]
        for b in buckets:
            if b.start_slot == s:
                acts += [("done", w) for w in b.waits_for]
                acts.append(("start", b.index))
        acts += [
            ("done", b.index)
            for b in buckets
            if b.done_slot == s and b.start_slot == s and b.index not in forced
        ]
        actions[s] = acts
    return actions
