"""Invariants of the pure multi-dimensional (tiered) plan, checked by
replaying its transfers the way a transport executes them."""

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxring import _jaxring


def simulate(plan):
    """Replays the plan on contribution counts: state[rank, elem, source].

    A transport's semantics: a reduce stores received + own contribution,
    where the own contribution is the input in the first phase and the
    result of the phase before in later ones; an all-gather step stores what
    came. A phase's first step sends the sender's own contribution (an
    all-gather's, its result). Phases of a ring run in order.
    """
    p, n = plan.world_size, plan.count
    state = np.zeros((p, n, p), np.int16)
    for r in range(p):
        state[r, :, r] = 1
    own = state.copy()
    current = None
    for t in plan.transfers():
        if (t["ring"], t["phase"]) != current:
            # A new phase starts from what the one before left (rings are
            # disjoint, so the whole-buffer snapshot is harmless).
            current = (t["ring"], t["phase"])
            own = state.copy()
        src, dst = t["src"], t["dst"]
        sl = slice(t["offset"], t["offset"] + t["count"])
        first = t["step"] == 0 and plan.phase(t["phase"])["kind"] != "all_gather"
        sent = (own if first else state)[src, sl]
        if t["reduce"]:
            state[dst, sl] = sent + own[dst, sl]
        else:
            state[dst, sl] = sent
    return state


def same_group_but(plan, a, b, tier):
    """a and b share every coordinate except (perhaps) the one of tier."""
    return all(plan.coord(a, i) == plan.coord(b, i) for i in range(len(plan.dims)) if i != tier)


def check_plan(dims, rings, count, elem, chunk):
    plan = _jaxring.TieredPlan(dims, rings, count, elem, chunk)
    p = plan.world_size
    assert p == math.prod(dims)
    transfers = plan.transfers()
    # Correctness: every element of every rank's result holds exactly one
    # contribution from each rank.
    state = simulate(plan)
    assert (state == 1).all(), "some element is missing or double-counts a rank"

    seen_send, seen_recv = set(), set()
    for t in transfers:
        ph = plan.phase(t["phase"])
        assert t["tier"] == ph["tier"]
        # Transfers stay inside the group of their tier and go to the next
        # rank of the ring.
        assert same_group_but(plan, t["src"], t["dst"], t["tier"])
        group = plan.group(t["ring"], t["phase"], t["src"])
        assert group == plan.group(t["ring"], t["phase"], t["dst"])
        i = group.index(t["src"])
        assert group[(i + 1) % len(group)] == t["dst"]
        # At each (ring, phase, unit) a rank sends at most once and receives
        # at most once.
        key = (t["ring"], t["phase"], t["unit"])
        assert (key, t["src"]) not in seen_send
        assert (key, t["dst"]) not in seen_recv
        seen_send.add((key, t["src"]))
        seen_recv.add((key, t["dst"]))
        assert 0 < t["count"] <= plan.chunk_elems
        # What the transport computes for each side matches the schedule.
        span = (t["offset"], t["count"])
        assert plan.send_span(t["ring"], t["phase"], t["src"], t["unit"]) == span
        assert plan.recv_span(t["ring"], t["phase"], t["dst"], t["unit"]) == span
        # The range stays inside the phase's shard, the same for both sides.
        shard = plan.shard(t["ring"], t["phase"], t["src"])
        assert shard == plan.shard(t["ring"], t["phase"], t["dst"])
        assert shard[0] <= t["offset"] and t["offset"] + t["count"] <= shard[0] + shard[1]

    # What a rank receives as unit u of a phase is what it sends on as unit
    # u + 1 (except after the phase's last step): the transport forwards it.
    for r in range(rings):
        for j in range(plan.num_phases):
            steps = plan.phase(j)["num_steps"]
            for rank in range(p):
                units = plan.num_units(r, j, rank)
                for u in range(units):
                    if u % steps != steps - 1:
                        assert plan.recv_span(r, j, rank, u) == plan.send_span(r, j, rank, u + 1)

    # Per tier, a rank sends 2(d-1)/d of its shard there, n / (product of
    # the tighter tiers): exactly when everything divides evenly, within one
    # element per ring and step otherwise.
    divisor = rings * p
    for rank in range(p):
        tighter = 1
        for tier, d in enumerate(dims):
            sent = (
                sum(t["count"] for t in transfers if t["src"] == rank and t["tier"] == tier) * elem
            )
            assert sent == plan.bytes_sent(rank, tier)
            formula = 2 * (d - 1) / d * count * elem / tighter
            if count % divisor == 0:
                assert sent == formula
            else:
                assert abs(sent - formula) <= 2 * (d - 1) * rings * elem
            tighter *= d
    return plan


TOPOLOGIES = [
    (1,),
    (2,),
    (5,),
    (2, 2),
    (2, 3),
    (3, 2),
    (4, 2),
    (2, 2, 2),
    (1, 4),
    (4, 1),
    (2, 1, 3),
    (3, 3),
    (2, 2, 3),
    (1, 1, 1),
]


@pytest.mark.parametrize("dims", TOPOLOGIES)
@pytest.mark.parametrize("count", [0, 1, 7, 48, 101, 997])
def test_tiered_plan_invariants_sweep(dims, count):
    for rings in (1, 2, 3):
        check_plan(list(dims), rings, count, 4, 64)


@settings(max_examples=120, deadline=None)
@given(
    dims=st.lists(st.integers(1, 4), min_size=1, max_size=3).filter(lambda d: math.prod(d) <= 16),
    rings=st.integers(1, 4),
    count=st.integers(0, 1500),
    elem=st.sampled_from([1, 2, 4, 8]),
    chunk=st.integers(1, 2048),
)
def test_tiered_plan_invariants_property(dims, rings, count, elem, chunk):
    check_plan(dims, rings, count, elem, chunk)


@pytest.mark.parametrize("p", list(range(1, 17)) + [24, 48, 64])
@pytest.mark.parametrize("count", [0, 1, 7, 101, 997])
def test_exchange_plan_is_recursive_doubling(p, count):
    """algorithm='exchange': one exchange of the whole part per factor 2 of
    the world size, then a ring allreduce over the odd rest; every element
    ends with one contribution of every rank, and each rank sends its whole
    part in every exchange."""
    dims = _jaxring.exchange_tiers(p)
    assert math.prod(dims) == p
    assert all(d == 2 for d in dims[:-1]) and (dims[-1] % 2 == 1 or dims[-1] == 2)
    for rings in (1, 3):
        plan = _jaxring.TieredPlan(dims, rings, count, 4, 64, exchange=True)
        assert plan.exchange and plan.world_size == p
        phases = [plan.phase(j) for j in range(plan.num_phases)]
        assert [ph["kind"] for ph in phases] == [
            "exchange" if d == 2 else "allreduce" for d in dims if d > 1
        ]
        # The steps that wait on the network: 3 for 8 ranks, 14 on a ring.
        steps = sum(ph["num_steps"] for ph in phases)
        odd = dims[-1] if dims[-1] % 2 else 1
        assert steps == sum(1 for d in dims if d == 2) + 2 * (odd - 1)
        assert (simulate(plan) == 1).all()
        transfers = plan.transfers()
        sent = {
            (t["ring"], t["phase"], t["unit"], t["src"], t["dst"]): (t["offset"], t["count"])
            for t in transfers
        }
        for t in transfers:
            assert same_group_but(plan, t["src"], t["dst"], t["tier"])
            if phases[t["phase"]]["kind"] == "exchange":
                # Partners: each sends the other the same range, to reduce.
                back = (t["ring"], t["phase"], t["unit"], t["dst"], t["src"])
                assert sent[back] == (t["offset"], t["count"]) and t["reduce"]
        for rank in range(p):
            for tier, d in enumerate(dims):
                if d == 2:
                    assert plan.bytes_sent(rank, tier) == count * 4


@pytest.mark.parametrize("p", [2, 3, 4, 7])
@pytest.mark.parametrize("rings", [1, 2, 3])
def test_one_tier_is_the_flat_ring(p, rings):
    """With one tier the tiered plan moves exactly what the flat plan does."""
    flat = _jaxring.RingPlan(p, rings, 1001, 4, 64)
    tiered = _jaxring.TieredPlan([p], rings, 1001, 4, 64)
    assert tiered.num_phases == 1 and tiered.phase(0)["kind"] == "allreduce"

    def key(t):
        return (
            t["ring"],
            t["chunk"],
            t["step"],
            t["src"],
            t["dst"],
            t["offset"],
            t["count"],
            t["reduce"],
        )

    assert sorted(map(key, flat.transfers())) == sorted(map(key, tiered.transfers()))


def test_phases_of_three_tiers():
    plan = _jaxring.TieredPlan([2, 3, 4], 1, 240, 4, 64)
    kinds = [(plan.phase(j)["kind"], plan.phase(j)["tier"]) for j in range(plan.num_phases)]
    assert kinds == [
        ("reduce_scatter", 0),
        ("reduce_scatter", 1),
        ("allreduce", 2),
        ("all_gather", 1),
        ("all_gather", 0),
    ]
    # Tier 0 varies fastest: ranks 0 and 1 share a tier-0 group.
    assert plan.group(0, 0, 0) == [0, 1]
    assert plan.group(0, 1, 0) == [0, 2, 4]
    assert plan.group(0, 2, 0) == [0, 6, 12, 18]
    # Odd rings run the other way round in every group.
    two_rings = _jaxring.TieredPlan([2, 3, 4], 2, 240, 4, 64)
    assert two_rings.group(1, 1, 0) == [0, 4, 2]
    # The loosest tier moves a sixth of what a flat ring would over it.
    flat = 2 * 23 / 24 * 240 * 4
    assert plan.bytes_sent(0, 2) == 2 * 3 / 4 * 240 * 4 / 6
    assert plan.bytes_sent(0, 2) < flat / 5


def test_tiers_of_size_one_are_skipped():
    plan = _jaxring.TieredPlan([1, 4, 1], 2, 100, 4, 64)
    assert plan.num_phases == 1 and plan.phase(0)["tier"] == 1
    assert plan.bytes_sent(0, 0) == plan.bytes_sent(0, 2) == 0
    assert _jaxring.TieredPlan([1, 1], 1, 10, 4, 64).num_phases == 0


def test_large_counts_use_64_bit_offsets():
    count = 3 * 2**31 + 7
    plan = _jaxring.TieredPlan([2, 2], 2, count, 1, 2**30)
    transfers = plan.transfers()
    assert max(t["offset"] + t["count"] for t in transfers) == count
    assert abs(plan.bytes_sent(3, 1) - 2 * 1 / 2 * count / 2) <= 2 * 2


def test_accessors_check_their_indices():
    plan = _jaxring.TieredPlan([2, 2], 2, 100, 4, 64)
    for call in (
        lambda: plan.shard(2, 0, 0),
        lambda: plan.group(0, 3, 0),
        lambda: plan.num_units(0, 0, 4),
        lambda: plan.send_span(-1, 0, 0, 0),
        lambda: plan.coord(0, 2),
        lambda: plan.bytes_sent(9, 0),
        lambda: plan.phase(3),
    ):
        with pytest.raises(IndexError):
            call()


@pytest.mark.parametrize(
    "bad",
    [
        ([], 1, 10, 4, 64),
        ([2, 0], 1, 10, 4, 64),
        ([2], 0, 10, 4, 64),
        ([2], 1, -1, 4, 64),
        ([2], 1, 10, 0, 64),
        ([2], 1, 10, 4, 0),
    ],
)
def test_tiered_plan_rejects_bad_arguments(bad):
    with pytest.raises(ValueError):
        _jaxring.TieredPlan(*bad)
