"""The pure bucket planner behind jaxring.overlap."""

import pytest
from hypothesis import given, settings, strategies as st

from jaxring._src.bucketing import Item, plan_buckets, split_item

MiB = 1 << 20


def item(key, mb, ready, needed):
    return Item(key=key, nbytes=int(mb * MiB), dtype="float32", ready=ready, needed=needed)


def test_first_bucket_is_small_then_bucket_cap():
    items = [item(i, 1, ready=10 + i, needed=100) for i in range(10)]
    plan = plan_buckets(
        items, first_bucket_bytes=1 * MiB, bucket_bytes=4 * MiB, max_inflight_bytes=None
    )
    assert [len(b.items) for b in plan.buckets] == [1, 4, 4, 1]
    # Each bucket starts when its last item is ready and is done at first need.
    assert [b.start_slot for b in plan.buckets] == [10, 14, 18, 19]
    assert all(b.done_slot == 100 for b in plan.buckets)


def test_items_are_bucketed_in_ready_order_not_list_order():
    items = [item("late", 1, ready=50, needed=90), item("early", 1, ready=5, needed=90)]
    plan = plan_buckets(items, first_bucket_bytes=MiB, bucket_bytes=MiB, max_inflight_bytes=None)
    assert [b.items[0].key for b in plan.buckets] == ["early", "late"]


def test_value_needed_early_is_not_held_back_by_later_ones():
    # A BatchNorm statistic: ready at 3, needed at 4; gradients come later.
    items = [
        item("stat", 0.001, ready=3, needed=4),
        item("g1", 0.001, ready=20, needed=40),
        item("g2", 0.001, ready=30, needed=40),
    ]
    plan = plan_buckets(items, first_bucket_bytes=MiB, bucket_bytes=MiB, max_inflight_bytes=None)
    keys = [[i.key for i in b.items] for b in plan.buckets]
    assert keys == [["stat"], ["g1", "g2"]]
    assert (plan.buckets[0].start_slot, plan.buckets[0].done_slot) == (3, 4)


def test_split_item_covers_every_element_once():
    it = Item(key="w", nbytes=4 * 1000, dtype="float32", ready=0, needed=9)
    parts = split_item(it, 4, 4 * 300)
    assert [p.count for p in parts] == [300, 300, 300, 100]
    assert [p.offset for p in parts] == [0, 300, 600, 900]
    assert [p.part for p in parts] == [0, 1, 2, 3]
    assert split_item(it, 4, 10**9)[0].count == 1000


def test_credit_window_bounds_bytes_in_flight():
    items = [item(i, 2, ready=i, needed=100) for i in range(6)]
    plan = plan_buckets(
        items, first_bucket_bytes=2 * MiB, bucket_bytes=2 * MiB, max_inflight_bytes=5 * MiB
    )
    assert max(_in_flight_profile(plan)) <= 5 * MiB
    # Bucket 2 cannot start before bucket 0 is done, and so on.
    assert plan.buckets[2].waits_for == [0]
    assert plan.buckets[0].done_slot == plan.buckets[2].start_slot


def test_bucket_bigger_than_the_window_still_runs_alone():
    items = [item(0, 8, ready=0, needed=10), item(1, 8, ready=1, needed=10)]
    plan = plan_buckets(
        items, first_bucket_bytes=8 * MiB, bucket_bytes=8 * MiB, max_inflight_bytes=MiB
    )
    assert plan.buckets[1].waits_for == [0]
    assert max(_in_flight_profile(plan)) == 8 * MiB


def test_rejects_an_item_needed_before_it_is_ready():
    with pytest.raises(ValueError, match="ready at slot 5 but needed at slot 2"):
        plan_buckets(
            [item(0, 1, ready=5, needed=2)],
            first_bucket_bytes=MiB,
            bucket_bytes=MiB,
            max_inflight_bytes=None,
        )


def _in_flight_profile(plan):
    """Bytes in flight after each action, replaying the plan's action list."""
    inflight, profile = {}, []
    for s in sorted(plan.actions):
        for kind, b in plan.actions[s]:
            if kind == "start":
                inflight[b] = plan.buckets[b].nbytes
            else:
                del inflight[b]
            profile.append(sum(inflight.values()))
    return profile


items_strategy = st.lists(
    st.tuples(st.integers(1, 3 * MiB), st.integers(0, 40), st.integers(0, 40)),
    min_size=0,
    max_size=30,
)


@settings(max_examples=300, deadline=None)
@given(
    items_strategy,
    st.integers(1, 4 * MiB),
    st.integers(1, 4 * MiB),
    st.one_of(st.none(), st.integers(1, 8 * MiB)),
)
def test_every_plan_is_a_valid_schedule(raw, first, cap, window):
    items = [
        Item(key=i, nbytes=n, dtype="f", ready=min(a, b), needed=max(a, b))
        for i, (n, a, b) in enumerate(raw)
    ]
    plan = plan_buckets(
        items, first_bucket_bytes=first, bucket_bytes=cap, max_inflight_bytes=window
    )
    # Every item is in exactly one bucket.
    keys = sorted(i.key for b in plan.buckets for i in b.items)
    assert keys == list(range(len(items)))
    seen = []
    for s in sorted(plan.actions):
        for kind, b in plan.actions[s]:
            seen.append((kind, b))
            bucket = plan.buckets[b]
            if kind == "start":
                assert s == bucket.start_slot
                assert all(i.ready <= s for i in bucket.items)
                # The credit window's waits come before the start.
                for w in bucket.waits_for:
                    assert ("done", w) in seen
            else:
                assert s == bucket.done_slot
                assert ("start", b) in seen
                assert all(i.needed >= s for i in bucket.items)
    assert sorted(seen) == sorted(
        [("start", b.index) for b in plan.buckets] + [("done", b.index) for b in plan.buckets]
    )
    if window is not None:
        biggest = max((b.nbytes for b in plan.buckets), default=0)
        assert max(_in_flight_profile(plan), default=0) <= max(window, biggest)


def test_window_makes_a_start_depend_on_dones_placed_before_it():
    # A is done at slot 3 (a statistic needed early), B starts at 5. The
    # executor runs by dataflow, so B's start must take A's results as
    # dependencies for the window to hold.
    items = [item("A", 2, ready=1, needed=3), item("B", 2, ready=5, needed=9)]
    plan = plan_buckets(
        items, first_bucket_bytes=2 * MiB, bucket_bytes=2 * MiB, max_inflight_bytes=3 * MiB
    )
    a, b = plan.buckets
    assert b.waits_for == [] and b.depends_on == [a.index]
