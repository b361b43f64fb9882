"""The processes of a CUDA ring agree on each call before it is compiled.

On the CPU the transport compares every frame's description (dtype, count,
op, rings, chunks, tiers) with the receiver's and raises MismatchError
when processes run different programs. NCCL's point-to-point calls carry
no description: ranks that disagree on the element count, the rings, the
chunk size or the tiers would post sends and receives of different sizes
and hang until the timeout, or mix up data. So, when a ring spans
processes, the process of its first rank publishes the call's description
in jax.distributed's key-value store under the call's slot id (the same in
every process that runs the same program, whatever its shapes:
call_sites.py), and every other process of the ring compares its own with
it at lowering, before anything runs.

A slot is lowered again whenever its program is traced again (a new batch
shape, a last partial batch), and a key of the store can be set only once.
So the key also holds how many times this process has lowered that slot
before: processes that run the same program lower each slot the same
number of times, in the same order, and the n-th lowering of a slot is
compared with the owner's n-th.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Iterable

from jaxring._src import cuda_backend, errors, jax_compat

_KEY = "jaxring/cuda/v1/call/{:x}/{}"
# How jax.distributed's client says a blocking get ran out of time (its
# status code, first in the message on every supported jax).
_DEADLINE = "DEADLINE_EXCEEDED"
_lock = threading.Lock()
_lowered = collections.Counter()  # slot id -> lowerings so far, this process


def _timed_out(exc: BaseException) -> bool:
    return str(exc).startswith(_DEADLINE)


def check_same_call(
    slot_id: int, description: str, owner: int, processes: Iterable[int], timeout_s: float
) -> None:
    """Publishes (in process `owner`) or checks (in the other `processes`)
    the description of the call at slot `slot_id`. Raises MismatchError if
    the owner lowered another call there, CollectiveTimeoutError if it did
    not lower one within timeout_s, JaxringError if the key-value store
    failed."""

    processes = set(processes)
    if len(processes) < 2:
        return
    me = jax_compat.distributed_state()[0]
    if me not in processes:
        return
    client = cuda_backend.job_client()
    slot = slot_id & (2**64 - 1)
    with _lock:
        n = _lowered[slot]
        _lowered[slot] += 1
    key = _KEY.format(slot, n)
    if me == owner:
        client.key_value_set(key, description)
        return
    try:
        theirs = client.blocking_key_value_get(key, int(timeout_s * 1000))
    except Exception as e:  # the client raises its own error types
        if not _timed_out(e):
            # The store itself failed (its coordinator gone, the job shut
            # down): not a peer that is late, so not a timeout.
            raise errors.JaxringError(
                f"jaxring.allreduce: the job's key-value store failed while this "
                f"process ({me}) waited for process {owner}'s description of "
                f"the allreduce at this place of the program: {e}",
                peer_process=owner,
            ) from e
        raise errors.CollectiveTimeoutError(
            f"jaxring.allreduce: process {owner} did not lower the allreduce at "
            f"this place of the program within {timeout_s} s (do all processes "
            f"run the same program?); this process ({me}) lowers it as "
            f"{description}: {e}",
            peer_process=owner,
        ) from e
    if theirs != description:
        raise errors.MismatchError(
            f"jaxring.allreduce: the processes lower different programs: "
            f"process {owner} lowers this allreduce as {theirs}, this process "
            f"({me}) as {description}. Every process must run the same "
            f"program with the same shapes, dtypes, ops and settings.",
            peer_process=owner,
        )
