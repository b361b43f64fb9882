"""The alpha-beta-gamma cost model, checked against the plans it models and
against the textbook ring formulas."""

import math

import pytest

from jaxring import _jaxring
from jaxring._src import cost_model as cm


def machine(dims, alphas=None, betas=None, shared=None, gamma=0.0):
    k = len(dims)
    alphas = alphas or [0.0] * k
    betas = betas or [1.0] * k
    shared = shared or [1] * k
    return cm.Machine(
        tuple(cm.Tier(d, a, b, s) for d, a, b, s in zip(dims, alphas, betas, shared)), gamma
    )


@pytest.mark.parametrize("p", [2, 3, 8])
@pytest.mark.parametrize("rings", [1, 2, 3])
def test_flat_ring_is_the_textbook_formula(p, rings):
    n, alpha, beta, gamma = 6e6, 1e-5, 1e-9, 2e-10
    m = cm.Machine((cm.Tier(p, alpha, beta),), gamma)
    segment = n / (p * rings)
    chunks = math.ceil(segment / 4096)
    want = (2 * (p - 1) + chunks - 1) * alpha + 2 * (p - 1) / p * n * beta + (p - 1) / p * n * gamma
    assert cm.flat_ring_time(m, n, rings, 4096) == pytest.approx(want)
    # One tier: the tiered plan is the flat ring.
    assert cm.tiered_time(m, n, rings, 4096) == pytest.approx(want)


@pytest.mark.parametrize("dims", [(2,), (2, 2), (4, 2), (2, 3, 2), (1, 4, 1, 2)])
def test_phases_are_the_plans(dims):
    plan = _jaxring.TieredPlan(list(dims), 1, 100, 4, 64)
    got = [(plan.phase(j)["kind"], plan.phase(j)["tier"]) for j in range(plan.num_phases)]
    assert cm.tiered_phases(dims) == got


@pytest.mark.parametrize("dims", [(2, 2), (4, 2), (2, 3, 2), (3, 1, 4)])
def test_tiered_bytes_are_the_plans(dims):
    """With no latency and no reduction cost, the model's time is the bytes
    a rank sends on each tier (the plan's own count) times that tier's beta."""
    count = 2 * 3 * 4 * math.prod(dims)  # divides evenly: exact bytes
    betas = [10.0 ** -(i + 1) for i in range(len(dims))]
    m = machine(dims, betas=betas)
    plan = _jaxring.TieredPlan(list(dims), 1, count, 4, 1 << 20)
    want = sum(plan.bytes_sent(0, t) * betas[t] for t in range(len(dims)))
    assert cm.tiered_time(m, count * 4, 1, 1 << 20) == pytest.approx(want)
    assert cm.tier_bytes(m, count * 4) == pytest.approx(
        [plan.bytes_sent(0, t) for t in range(len(dims))]
    )


def test_two_hosts_of_two():
    """The bytes through a slow host link: a flat ring of 4 crosses it at two
    hops, 1.5 n each way; the tiered plan sends the half-shards, n. With a
    link per process and one ring, the formula's 3x (1.5 n against 0.5 n)."""
    n = 1e8
    shared_link = machine((2, 2), betas=[0.0, 1.0], shared=[1, 2])
    ratio = cm.flat_ring_time(shared_link, n, 2, 1 << 20) / cm.tiered_time(
        shared_link, n, 2, 1 << 20
    )
    assert ratio == pytest.approx(1.5)
    own_links = machine((2, 2), betas=[0.0, 1.0])
    ratio = cm.flat_ring_time(own_links, n, 1, 1 << 20) / cm.tiered_time(own_links, n, 1, 1 << 20)
    assert ratio == pytest.approx(3.0)


def test_tiered_plan_has_fewer_latencies():
    # 8 x 8: 2 * 63 steps for the flat ring; 7 + 14 + 7 for the tiered plan.
    m = machine((8, 8), alphas=[1.0, 1.0], betas=[0.0, 0.0])
    assert cm.flat_ring_time(m, 64, 1, 1 << 20) == 2 * 63
    assert cm.tiered_time(m, 64, 1, 1 << 20) == 7 + 14 + 7


def test_bad_tiers_are_refused():
    with pytest.raises(ValueError):
        cm.Tier(0, 0.0, 0.0)
    with pytest.raises(ValueError):
        cm.Tier(2, -1.0, 0.0)


@pytest.mark.parametrize("p", range(1, 25))
def test_exchange_steps_are_the_plans(p):
    assert cm.exchange_tiers(p) == list(_jaxring.exchange_tiers(p))


@pytest.mark.parametrize("p", [2, 8, 16])
@pytest.mark.parametrize("rings", [1, 2])
def test_exchange_is_the_textbook_recursive_doubling(p, rings):
    # log2(p) steps, each sending and adding the whole buffer.
    n, alpha, beta, gamma = 6e6, 1e-5, 1e-9, 2e-10
    m = cm.Machine((cm.Tier(p, alpha, beta),), gamma)
    steps = int(math.log2(p))
    chunks = math.ceil(n / rings / 4096)
    want = steps * (chunks * alpha + n * beta + n * gamma)
    assert cm.exchange_time(m, n, rings, 4096) == pytest.approx(want)


def test_exchange_with_an_odd_rest_ends_in_a_ring_over_it():
    n, alpha, beta = 1e6, 1e-5, 1e-9
    m12 = cm.Machine((cm.Tier(12, alpha, beta),))
    m3 = cm.Machine((cm.Tier(3, alpha, beta),))
    step = alpha + n * beta  # one exchange step, one chunk
    assert cm.exchange_time(m12, n, 1, 1 << 30) == pytest.approx(
        2 * step + cm.flat_ring_time(m3, n, 1, 1 << 30)
    )


def test_exchange_beats_the_ring_where_latency_dominates_only():
    m = cm.Machine((cm.Tier(8, 50e-6, 1 / 5e6),))  # 50 us, 5 MB/s
    assert cm.exchange_time(m, 256, 1, 1 << 20) < cm.flat_ring_time(m, 256, 1, 1 << 20)
    assert cm.exchange_time(m, 64 << 10, 1, 1 << 20) > cm.flat_ring_time(m, 64 << 10, 1, 1 << 20)


def test_emulated_machine_is_the_link_emulation_of_config():
    one = cm.emulated_machine(((0, 5e6, 50e-6),), 8)
    assert one == cm.Machine((cm.Tier(8, 50e-6, 1 / 5e6, 1),))
    # A tier's link belongs to a group of the tier below: a host's 4 ranks
    # share the one 1 Gbit link (link_pacing.h).
    two = cm.emulated_machine(((4, 12.5e9, 2e-6), (0, 125e6, 20e-6)), 8)
    assert two.dims == (4, 2)
    assert [t.shared_by for t in two.tiers] == [1, 4]
    assert [t.alpha_s for t in two.tiers] == [2e-6, 20e-6]
    assert two.tiers[1].beta_s_per_byte == pytest.approx(8e-9)
    # Tiers that do not divide the world: no machine.
    assert cm.emulated_machine(((4, 1e9, 0.0), (0, 1e9, 0.0)), 6) is None


def test_exchange_steps_cross_the_tier_their_partners_straddle():
    # 2 ranks per host on a free tier, 4 hosts: partners 1 apart meet on
    # the host tier (no cost), 2 and 4 apart on the network, whose link the
    # 2 ranks of a host share.
    n, alpha, beta = 1e6, 1e-5, 1e-9
    m = machine((2, 4), alphas=[0.0, alpha], betas=[0.0, beta], shared=[1, 2])
    assert cm.tier_at_stride(m, 1) is m.tiers[0]
    assert cm.tier_at_stride(m, 2) is m.tiers[1] and cm.tier_at_stride(m, 4) is m.tiers[1]
    assert cm.exchange_time(m, n, 1, 1 << 30) == pytest.approx(2 * (alpha + 2 * n * beta))
