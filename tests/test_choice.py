"""What an allreduce runs (choice.py): pure checks of the decision, with
no lowering. The lowering tests (test_allreduce.py, test_cuda_backend.py)
check that each call carries what the choice says."""

import dataclasses

import numpy as np
import pytest

import jaxring
from jaxring._src import choice, cost_model, host_segment
from jaxring._src.choice import resolve_algorithm
from jaxring._src.config import parse_links

pytestmark = pytest.mark.jax_independent

ONE_PROCESS = np.zeros(4, np.int64)
TWO_PROCESSES = np.array([0, 0, 1, 1], np.int64)


def cpu(algorithm="auto", topology="auto", rank_process=TWO_PROCESSES, **kw):
    args = dict(link=(), hosts=None, world=4, nbytes=1 << 20, rings=2, chunk_bytes=1 << 16)
    return choice.for_cpu(
        algorithm=algorithm, topology=topology, rank_process=rank_process, **{**args, **kw}
    )


def cuda(algorithm="auto", topology="auto", dtype=np.float32, **kw):
    args = dict(rank_process=TWO_PROCESSES, hosts=None, world=4, rings=2, chunk_bytes=1 << 20)
    return choice.for_cuda(algorithm=algorithm, topology=topology, dtype=dtype, **{**args, **kw})


def test_a_choice_is_frozen_and_carries_what_the_call_runs():
    chosen = cpu(rank_process=ONE_PROCESS)
    assert chosen == choice.Choice("direct", (), 2, 1 << 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        chosen.algorithm = "ring"


def test_cpu_tiers_belong_to_the_ring_plan_alone():
    # Two processes of two devices, no host segment here: the tiered ring.
    assert host_segment.unavailable() is not None
    assert cpu() == choice.Choice("ring", (2, 2), 2, 1 << 16)
    assert cpu(hosts={0: "a", 1: "a"}).tiers == (2, 2)
    assert cpu(topology="flat").tiers == ()
    # The exchange and direct have no plan of rings: no tiers, whether
    # chosen by "auto" (a small operand) or asked for.
    assert cpu(nbytes=64) == choice.Choice("exchange", (), 2, 1 << 16)
    assert cpu(algorithm="exchange").tiers == ()
    with pytest.raises(ValueError, match="picks its own tiers"):
        cpu(algorithm="exchange", topology=(2, 2))


def test_cpu_rings_of_different_sizes_run_flat():
    assert cpu(uneven_groups=True) == choice.Choice("ring", (), 2, 1 << 16)
    assert cpu(uneven_groups=True, topology=(4,)).tiers == ()  # one tier: flat
    with pytest.raises(NotImplementedError, match="different sizes"):
        cpu(uneven_groups=True, topology=(2, 2))


def test_cuda_auto_runs_nccl_in_one_call_unless_nccl_cannot():
    # NCCL's allreduce: one call on one communicator, whatever the rings.
    assert cuda() == choice.Choice("nccl", (), 1, 1 << 20)
    assert cuda(algorithm="nccl", rings=4) == choice.Choice("nccl", (), 1, 1 << 20)
    assert cuda(topology=(4,)).algorithm == "nccl"  # one tier: flat
    # The ring where NCCL cannot run it: 16-bit integers, named tiers.
    assert cuda(dtype=np.int16) == choice.Choice("ring", (), 2, 1 << 20)
    assert cuda(dtype=np.uint16).algorithm == "ring"
    assert cuda(topology=(2, 2)) == choice.Choice("ring", (2, 2), 2, 1 << 20)
    assert cuda(algorithm="ring") == choice.Choice("ring", (), 2, 1 << 20)
    with pytest.raises(ValueError, match="no\\s+tiers"):
        cuda(algorithm="nccl", topology=(2, 2))
    with pytest.raises(TypeError, match="no 16-bit integer"):
        cuda(algorithm="nccl", dtype=np.int16)
    for cpu_only in ("direct", "exchange"):
        with pytest.raises(ValueError, match="on GPU use"):
            cuda(algorithm=cpu_only)


def test_auto_takes_direct_across_processes_that_share_the_host_segment(monkeypatch):
    """Where the job's processes share the host segment, "auto" runs direct
    across them, at every size, whatever exchange_max_bytes says (so that
    processes reaching one call site with different shapes run one
    algorithm) and in place of the tiers it derives for several devices
    per process; never under an emulated link, or where a topology is set.
    Without the segment, the ring as before."""
    two, four = np.array([0, 1], np.int64), np.array([0, 1, 2, 3], np.int64)

    def auto(ranks, nbytes, **kw):
        return resolve_algorithm(
            "auto", kw.pop("link", ()), ranks, nbytes=nbytes, world=len(ranks), **kw
        )

    assert host_segment.unavailable() is not None  # no job here: the ring
    assert auto(four, 1 << 20) == "ring"
    monkeypatch.setattr(host_segment, "unavailable", lambda: None)
    assert auto(four, 4) == auto(four, 1 << 30) == "direct"  # the default 512 B too
    assert auto(two, 4) == auto(two, 1 << 30) == "direct"
    assert auto(four, 1 << 20, topology="flat") == "ring"  # asks for the ring plan
    assert auto(four, 1 << 20, tiered=True) == "direct"  # the tiers "auto" derived
    assert auto(four, 1 << 20, tiered=True, topology=(2, 2)) == "ring"
    assert auto(four, 1 << 20, link=((0, 1e9, 0.0),)) == "ring"
    assert resolve_algorithm("direct", (), four) == "direct"
    jaxring.config.update("exchange_max_bytes", 4096)
    try:
        assert auto(four, 4096) == auto(two, 64) == "direct"
    finally:
        jaxring.config.reset("exchange_max_bytes")


def test_direct_refused_across_processes():
    one, two = np.zeros(4, np.int64), np.array([0, 0, 1, 1], np.int64)
    assert resolve_algorithm("auto", (), one) == "direct"
    assert resolve_algorithm("auto", (), two) == "ring"
    assert resolve_algorithm("ring", (), one) == "ring"
    # Across processes, direct needs the host segment, which a process
    # without the transport set up has not got: it says so.
    with pytest.raises(ValueError, match="across processes runs over shared memory"):
        resolve_algorithm("direct", (), two)
    # An emulated link of an operand of unknown size, or a tiered plan: rings.
    assert resolve_algorithm("auto", ((0, 1e9, 0.0),), one) == "ring"
    assert resolve_algorithm("auto", (), one, tiered=True) == "ring"
    # Across processes "auto" takes exchange for small operands, where the
    # topology is left to "auto" too (a tuple or "flat" asks for the ring).
    # (exchange_max_bytes: 512 by default; 0 turns it off).
    assert resolve_algorithm("auto", (), two, nbytes=512) == "exchange"
    assert resolve_algorithm("auto", (), two, nbytes=513) == "ring"
    jaxring.config.update("exchange_max_bytes", 0)
    try:
        assert resolve_algorithm("auto", (), two, nbytes=0) == "ring"
    finally:
        jaxring.config.reset("exchange_max_bytes")
    jaxring.config.update("exchange_max_bytes", 4096)
    try:
        assert resolve_algorithm("auto", (), two, nbytes=4096) == "exchange"
        assert resolve_algorithm("auto", (), two, nbytes=4097) == "ring"
        assert resolve_algorithm("auto", (), two, tiered=True, nbytes=64) == "exchange"
        assert resolve_algorithm("auto", (), two, nbytes=64, topology=(2, 2)) == "ring"
        assert resolve_algorithm("auto", (), two, nbytes=64, topology="flat") == "ring"
        assert resolve_algorithm("auto", (), one, nbytes=64) == "direct"
        # So under an emulated link, where every plan is modelled alike.
        link = ((0, 1e9, 0.0),)
        assert resolve_algorithm("auto", link, one, nbytes=64) == "exchange"
        assert resolve_algorithm("auto", link, one, nbytes=4097) == "ring"
        assert resolve_algorithm("auto", link, one, nbytes=64, topology="flat") == "ring"
    finally:
        jaxring.config.reset("exchange_max_bytes")
    # The exchange plan runs anywhere on the CPU, but picks its own tiers.
    assert resolve_algorithm("exchange", (), two) == "exchange"
    assert resolve_algorithm("exchange", ((0, 1e9, 0.0),), one) == "exchange"
    with pytest.raises(ValueError, match="picks its own tiers"):
        resolve_algorithm("exchange", (), two, tiered=True)


def test_auto_under_one_emulated_link_takes_the_exchange_where_its_model_does():
    one = np.zeros(8, np.int64)
    slow = parse_links("41Mbit,50us")

    def pick(nbytes, link=slow, **kw):
        return resolve_algorithm(
            "auto", link, one, nbytes=nbytes, world=8, rings=2, chunk_bytes=1 << 20, **kw
        )

    def model_says_exchange(nbytes, link=slow):
        m = cost_model.emulated_machine(link, 8)
        return cost_model.exchange_time(m, nbytes, 2, 1 << 20) < cost_model.flat_ring_time(
            m, nbytes, 2, 1 << 20
        )

    # 41 Mbit with 50 us: the model's crossover lies between 1 and 8 KiB,
    # above the default exchange_max_bytes (512).
    assert model_says_exchange(1024) and not model_says_exchange(8192)
    assert pick(1024) == "exchange" and pick(8192) == "ring"
    assert pick(1024, topology="flat") == "ring"
    # A fast link without latency: the model never prefers the exchange,
    # and the default threshold still applies.
    fast = parse_links("100Gbit")
    assert not model_says_exchange(256, fast)
    assert pick(512, fast) == "exchange" and pick(1024, fast) == "ring"
    # The model counts no CPU time: it chooses the exchange up to 16 KiB only.
    latent = parse_links("100Gbit,5us")
    assert model_says_exchange(16385, latent) and model_says_exchange(65536, latent)
    assert pick(16384, latent) == "exchange"
    assert pick(16385, latent) == "ring" and pick(65536, latent) == "ring"
    # Tiers: the flat ring's model does not hold across them; the threshold
    # alone decides.
    assert pick(1024, parse_links("4:100Gbit,2us;1Gbit,20us")) == "ring"
    # An exchange_max_bytes set explicitly is the rule, even to the default.
    for limit in (0, 512):
        jaxring.config.update("exchange_max_bytes", limit)
        try:
            assert pick(1024) == "ring"
        finally:
            jaxring.config.reset("exchange_max_bytes")
    assert pick(1024) == "exchange"
