"""What an allreduce runs: the algorithm, the ring plan's tiers, rings and
chunk size, on either backend; and the settings a tuning table fills in for
an operation's size.

Two moments decide. At trace time an operation's size is known, and
tuned_settings puts the tuning table's choice for it in place of the
settings left to their defaults. At lowering, where its ranks run is known,
and for_cpu or for_cuda returns the Choice the custom call carries.

Apart from the lowering: each function takes the facts it decides on (the
rank table, the hosts, the emulated link, the operand's bytes and dtype) as
arguments. Beyond them it reads the settings (jaxring.config), whether the
host segment is there, and, for the tuning table's key, JAX's backend and
process count.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from jaxring._src import cost_model, host_segment, topology as _topology, tuning as _tuning
from jaxring._src.config import config, validate
from jaxring._src.dtypes import NCCL_DTYPES


@dataclasses.dataclass(frozen=True)
class Choice:
    """What one allreduce runs.

    algorithm: "ring", "direct" or "exchange" on CPU, "ring" or "nccl" on
    CUDA. tiers: the ring plan's tiers, tightest first; () for one flat ring
    and for every other algorithm. rings, chunk_bytes: as the call runs
    them.
    """

    algorithm: str
    tiers: tuple
    rings: int
    chunk_bytes: int


def for_cpu(
    *,
    algorithm: str,
    topology: Any,
    link: tuple,
    rank_process,
    hosts,
    world: int,
    nbytes: int,
    rings: int,
    chunk_bytes: int,
    uneven_groups: bool = False,
) -> Choice:
    """The CPU backend's Choice for an operation of nbytes over world ranks
    per ring, whose processes rank_process gives (one row of world per ring)
    and hosts places; uneven_groups: axis_index_groups of different sizes,
    whose rings of different sizes run flat."""
    if uneven_groups and topology not in ("auto", "flat") and _topology.normalized(tuple(topology)):
        raise NotImplementedError(
            f"jaxring: topology {tuple(topology)} asks for a tiered plan, but "
            "axis_index_groups of different sizes make rings of different "
            "sizes, which run as flat rings; use topology='flat' or 'auto'."
        )
    tiers = () if uneven_groups else _topology.resolve(topology, world, rank_process, hosts)
    if algorithm in ("exchange", "direct") and topology == "auto":
        tiers = ()  # the tiers "auto" finds are the ring plan's
    chosen = resolve_algorithm(
        algorithm,
        link,
        rank_process,
        tiered=bool(tiers),
        nbytes=nbytes,
        topology=topology,
        world=world,
        rings=rings,
        chunk_bytes=chunk_bytes,
    )
    if chosen in ("exchange", "direct"):
        tiers = ()
    return Choice(chosen, tuple(tiers), rings, chunk_bytes)


def for_cuda(
    *,
    algorithm: str,
    topology: Any,
    dtype,
    rank_process,
    hosts,
    world: int,
    rings: int,
    chunk_bytes: int,
) -> Choice:
    """The CUDA backend's Choice: "nccl" or "ring", and the tiers an
    explicit topology names (checked as on CPU); none for "flat" and, on
    GPUs, for "auto" too, which stays flat until a GPU run has checked
    derived tiers.

    "auto" takes NCCL's allreduce, which moved every size measured faster
    than jaxring's ring (docs/gpu.md), and the ring where NCCL cannot run
    the operation: 16-bit integers, or tiers named. NCCL's allreduce runs as
    one call on one communicator, so its Choice has one ring; the ring's
    count is taken as it is: each ring is an NCCL communicator driven from
    the GPU, not threads on the host's cores."""
    tiers = (
        ()
        if topology in ("auto", "flat")
        else tuple(_topology.resolve(topology, world, rank_process, hosts))
    )
    if algorithm == "auto":
        nccl_runs_it = not tiers and np.dtype(dtype) in NCCL_DTYPES
        chosen = "nccl" if nccl_runs_it else "ring"
    else:
        chosen = _cuda_algorithm(algorithm, dtype)
    if chosen == "nccl":
        if tiers:
            raise ValueError(
                f"jaxring: algorithm='nccl' runs NCCL's own allreduce, which has "
                f"no tiers, but topology {tuple(topology)} asks for a tiered plan; "
                "use algorithm='ring' with it, or topology='flat'."
            )
        rings = 1
    return Choice(chosen, tiers, rings, chunk_bytes)


def _cuda_algorithm(algorithm: str, dtype) -> str:
    """The algorithm a CUDA call asked for by name, or why it cannot run."""
    if algorithm == "ring":
        return "ring"
    if algorithm == "direct":
        raise ValueError(
            "jaxring: algorithm='direct' reads peers' host memory and exists on "
            "the CPU backend only; on GPU use 'ring', 'nccl' or 'auto'."
        )
    if algorithm == "exchange":
        raise ValueError(
            "jaxring: algorithm='exchange' runs on the CPU transports only; on "
            "GPU use 'ring', 'nccl' (NCCL picks its own small-message "
            "algorithms) or 'auto'."
        )
    if np.dtype(dtype) not in NCCL_DTYPES:
        raise TypeError(
            f"jaxring: algorithm='nccl' cannot reduce {np.dtype(dtype)} (NCCL "
            "has no 16-bit integer types); use algorithm='ring'."
        )
    return "nccl"


def resolve_algorithm(
    algorithm: str,
    link,
    rank_process,
    tiered: bool = False,
    nbytes: int | None = None,
    topology: Any = "auto",
    world: int = 0,
    rings: int = 1,
    chunk_bytes: int = 1 << 20,
) -> str:
    """ "ring", "direct" or "exchange" for an operation, from the setting and
    where its ranks run. "auto" takes direct where it applies: no emulated
    link (which models the transfers of a plan, and direct has none), and
    either every rank in this process (direct reads its peers' memory) and
    no tiered plan (a plan of rings), or, with the topology setting left to
    "auto", in processes of this host that share the host segment, however
    many devices each holds (the tiers "auto" derives there are the ring
    plan's, which direct replaces). Elsewhere
    across processes, and under an emulated link, it takes exchange for an
    operand of nbytes up to config.exchange_max_bytes, where the topology
    setting is "auto" (a tuple or "flat" asks for the ring plan). Under one
    emulated link (not tiers) whose exchange_max_bytes was left unset, also
    where the cost model of that link predicts the exchange faster than the
    ring for the world's ranks, up to MODELLED_EXCHANGE_MAX_BYTES: the link
    is known exactly there, as a tuning table knows a measured one."""
    across = _topology.spans_processes(rank_process)
    emulated = bool(link)
    if algorithm == "auto":
        if across and not emulated and topology == "auto" and host_segment.unavailable() is None:
            # Over the host segment direct beat the ring, the exchange and
            # the tiered ring wherever measured (docs/multiprocess.md). It
            # takes no size into account, so processes that reach one call
            # site with different shapes run the same algorithm, whose
            # entries tell them apart (MismatchError) rather than wait on
            # each other.
            return "direct"
        if (across or emulated) and topology == "auto" and nbytes is not None:
            limit = config.exchange_max_bytes  # 0: never
            if 0 < limit and nbytes <= limit:
                return "exchange"
            if (
                emulated
                and not config.is_explicit("exchange_max_bytes")
                and _exchange_faster_on(link, world, nbytes, rings, chunk_bytes)
            ):
                return "exchange"
        return "ring" if across or emulated or tiered else "direct"
    if algorithm == "nccl":
        raise ValueError(
            "jaxring: algorithm='nccl' runs NCCL's allreduce and exists on the "
            "CUDA backend only; on CPU use 'ring', 'direct', 'exchange' or 'auto'."
        )
    if algorithm == "exchange" and tiered:
        raise ValueError(
            "jaxring: algorithm='exchange' picks its own tiers (one exchange per "
            "factor 2 of the world size), so it takes no tiered topology; use "
            "topology='flat' or 'auto' with it, or algorithm='ring'."
        )
    if algorithm == "direct" and across and host_segment.unavailable():
        raise ValueError(
            "jaxring: algorithm='direct' across processes runs over shared "
            "memory that every process of a job on one host maps, which this "
            f"job does not have: {host_segment.unavailable()}. Use "
            "algorithm='ring' or 'auto'."
        )
    if algorithm == "direct" and tiered:
        raise ValueError(
            "jaxring: algorithm='direct' has no tiers, and a tiered topology "
            "runs the ring plan; use algorithm='ring' or 'auto', or "
            "topology='flat'."
        )
    if algorithm == "direct" and emulated:
        raise ValueError(
            "jaxring: algorithm='direct' has no transfers for cpu_link to "
            "emulate; use algorithm='ring' or 'auto' with cpu_link, or unset "
            "cpu_link."
        )
    return algorithm


# The largest buffer for which the model may choose the exchange. It counts
# no CPU time, and the exchange copies and reduces the whole buffer at each
# of its steps, so on a fast link with latency it predicts the exchange
# faster well past where it is; up to this size its choice held wherever
# measured (docs/allreduce.md, "Why the 16 KiB cap").
MODELLED_EXCHANGE_MAX_BYTES = 16 << 10


def _exchange_faster_on(link: tuple, world: int, nbytes: int, rings: int, chunk_bytes: int) -> bool:
    """Whether the cost model of the emulated link predicts the exchange
    faster than the flat ring for nbytes over world ranks. One link only:
    across tiers the model paces a flat ring at its slowest hop at every
    step, where the ring's critical path crosses the slow hops only now and
    then (with "4:100Gbit,2us;1Gbit,20us" it predicted the exchange faster
    up to 12 KiB; it was slower from 4 KiB)."""
    machine = cost_model.emulated_machine(link, world)
    if machine is None or len(link) != 1 or world < 2 or nbytes > MODELLED_EXCHANGE_MAX_BYTES:
        return False
    return cost_model.exchange_time(
        machine, nbytes, rings, chunk_bytes
    ) < cost_model.flat_ring_time(machine, nbytes, rings, chunk_bytes)


def tunable_settings(**passed) -> set:
    """What a tuning table may fill in: the settings of `passed` (name:
    argument) neither passed (None) nor set."""
    return {name for name, arg in passed.items() if arg is None and not config.is_explicit(name)}


def tuned_settings(
    tunable: set,
    world: int,
    nbytes: int,
    rings: int,
    chunk_bytes: int,
    algorithm: str,
    topology: Any,
) -> tuple[int, int, str, Any, bool]:
    """rings, chunk_bytes, algorithm and topology, with the tuning table's
    choice for this message size in place of those left at their defaults;
    and whether a table gave one."""
    if not tunable:
        return rings, chunk_bytes, algorithm, topology, False
    key = _tuning.key(jax.default_backend(), world, jax.process_count())
    choice = _tuning.tuned_choice(
        config.tuning, key, nbytes, across_processes=jax.process_count() > 1
    )
    if choice is None:
        return rings, chunk_bytes, algorithm, topology, False
    if "rings" in tunable:
        rings = choice.rings
    if "chunk_bytes" in tunable:
        chunk_bytes = choice.chunk_bytes
    if "algorithm" in tunable:
        # "auto" still takes the ring where direct does not apply (link
        # emulation, named tiers, processes on several hosts).
        algorithm = "auto" if choice.algorithm == "direct" else choice.algorithm
        if algorithm == "exchange" and "topology" not in tunable:
            # A topology the caller set asks for the ring plan, as it does
            # of "auto" (resolve_algorithm).
            algorithm = "ring"
    if "topology" in tunable and ("algorithm" in tunable or algorithm != "auto"):
        # Not under an algorithm set to "auto": the table's "flat" at some
        # sizes (ring or exchange) and "auto" at others (direct, where the
        # processes share the host segment) would mix direct with the ring
        # by size, which select() keeps the table's own choices from doing.
        # "flat" or "auto": the table never names tiers, so it cannot ask
        # for tiers this layout does not have. Direct has no plan: "auto"
        # lets it run across processes too (where the tuner measures it:
        # processes that share the host segment, as "auto" takes it).
        topology = (
            "auto"
            if choice.algorithm == "direct"
            else validate("topology", choice.topology, "jaxring tuning table")
        )
    return rings, chunk_bytes, algorithm, topology, True
