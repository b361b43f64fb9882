"""Invariants of the pure ring plan, checked by simulating its transfers."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from jaxring import _jaxring

PRIMES = [2, 3, 7, 13, 101, 997]


def simulate(plan):
    """Replays the plan on contribution counts: state[rank, elem, source]."""
    p, n = plan.world_size, plan.count
    state = np.zeros((p, n, p), np.int16)
    for r in range(p):
        state[r, :, r] = 1
    own = state.copy()
    for t in plan.transfers():
        src, dst = t["src"], t["dst"]
        sl = slice(t["offset"], t["offset"] + t["count"])
        if t["reduce"]:
            state[dst, sl] = state[src, sl] + own[dst, sl]
        else:
            state[dst, sl] = state[src, sl]
    return state


def check_plan(p, rings, count, elem, chunk):
    plan = _jaxring.RingPlan(p, rings, count, elem, chunk)
    transfers = plan.transfers()
    # Every element of every rank's result holds exactly one contribution
    # from each rank.
    state = simulate(plan)
    assert (state == 1).all(), "some element is missing or double-counts a rank"
    # Sends and receives pair up between ring neighbours, and at each
    # (ring, chunk, step) a rank sends at most once and receives at most once.
    seen_send, seen_recv = set(), set()
    for t in transfers:
        order = plan.order(t["ring"])
        i = order.index(t["src"])
        assert order[(i + 1) % p] == t["dst"]
        key = (t["ring"], t["chunk"], t["step"])
        assert (key, t["src"]) not in seen_send
        assert (key, t["dst"]) not in seen_recv
        seen_send.add((key, t["src"]))
        seen_recv.add((key, t["dst"]))
        assert 0 < t["count"] <= plan.chunk_elems
    # Per-rank traffic is the ring optimum 2(p-1)/p of the buffer, exactly
    # when the parts divide evenly, within one element per ring and step
    # otherwise.
    for r in range(p):
        sent = sum(t["count"] for t in transfers if t["src"] == r) * elem
        assert sent == plan.bytes_sent(r)
        optimum = 2 * (p - 1) / p * count * elem
        if count % (p * rings) == 0:
            assert sent == optimum
        else:
            assert abs(sent - optimum) <= 2 * (p - 1) * rings * elem
    return plan


@pytest.mark.parametrize("p", range(1, 17))
@pytest.mark.parametrize("count", [0, 1, 4, 100, 1000] + PRIMES)
def test_plan_invariants_sweep(p, count):
    for rings in (1, 2, 3, 4):
        check_plan(p, rings, count, 4, 64)


@settings(max_examples=150, deadline=None)
@given(
    p=st.integers(1, 16),
    rings=st.integers(1, 4),
    count=st.integers(0, 3000),
    elem=st.sampled_from([1, 2, 4, 8]),
    chunk=st.integers(1, 4096),
)
def test_plan_invariants_property(p, rings, count, elem, chunk):
    check_plan(p, rings, count, elem, chunk)


def test_rings_use_both_directions():
    plan = _jaxring.RingPlan(5, 4, 1000, 4, 256)
    assert plan.order(0) == [0, 1, 2, 3, 4]
    assert plan.order(1) == [0, 4, 3, 2, 1]
    assert plan.order(0) != plan.order(1)
    # The link 0->1 of ring 0 is used as 1->0 by ring 1.
    assert plan.order(1)[-1] == 1 and plan.order(1)[0] == 0


def test_counts_above_2_31_use_64_bit_offsets():
    count = 3 * 2**31 + 7
    plan = _jaxring.RingPlan(4, 2, count, 1, 2**30)
    transfers = plan.transfers()
    assert max(t["offset"] + t["count"] for t in transfers) == count
    assert sum(t["count"] for t in transfers) * 1 == sum(plan.bytes_sent(r) for r in range(4))
    covered = {}
    for t in transfers:
        if t["step"] == plan.num_steps - 1:  # last all-gather step: one span each
            covered.setdefault(t["dst"], 0)
            covered[t["dst"]] += t["count"]
    # In the last step each rank receives the segments of its ring part it
    # did not yet have: one segment per ring.
    assert sum(covered.values()) == count
    optimum = 2 * 3 / 4 * count
    assert abs(plan.bytes_sent(1) - optimum) <= 2 * 3 * 2


@pytest.mark.parametrize(
    "bad",
    [(0, 1, 10, 4, 64), (2, 0, 10, 4, 64), (2, 1, -1, 4, 64), (2, 1, 10, 0, 64), (2, 1, 10, 4, 0)],
)
def test_plan_rejects_bad_arguments(bad):
    with pytest.raises(ValueError):
        _jaxring.RingPlan(*bad)
