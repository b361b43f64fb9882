"""The host segment: the shared memory on which algorithm="direct" runs
across the processes of a job that all run on one host
(xla_ffi/cpu/direct/host_segment.h).

Set up once, with the TCP transport, through the job's key-value store:
process 0 creates the segment and publishes its name, every other process
maps it and publishes whether it could, and process 0 publishes the
decision every process follows: the segment is used only if every process
mapped it (a process whose JAXRING_TRANSPORT is tcp maps nothing, so it
turns the segment off for all). Process 0 removes the name from /dev/shm
as soon as every other process said whether it mapped the segment, and
whatever way the set-up ends: an exception (KeyboardInterrupt included)
abandons it here, and SIGTERM, SIGINT and exit() reach the handlers of
xla_ffi/cpu/shm_segment.h. A process 0 killed outright leaves the name to
the next job's remove_stale (below)."""

from __future__ import annotations

import json
import threading
import time

from jaxring._src import lib

_PREFIX = "jaxring/host_segment/v1/"
_NAME_KEY = _PREFIX + "name"
_STATUS_KEY = _PREFIX + "status/{}"
_DECISION_KEY = _PREFIX + "decision"

_lock = threading.Lock()
_missing: str | None = "the transport between processes is not set up yet"


TCP_ONLY = "JAXRING_TRANSPORT=tcp keeps every byte between processes on sockets"


def set_up(
    client,
    me: int,
    processes: int,
    ranks: int,
    job_id: bytes,
    one_host: bool,
    use_shm: bool,
    timeout_ms: int,
) -> None:
    """Makes the host segment available to this process, or records why
    not. Every process of the job calls it, with the same one_host (it
    comes from records every process read); use_shm is this process's own
    JAXRING_TRANSPORT, which the processes settle between them (one with
    tcp turns the segment off for all). Every process ends with process
    0's decision, or raises: a process that ran direct while another ran a
    ring would wait on it until the timeout."""
    global _missing

    if not one_host:
        why = "the job's processes run on more than one host"
    else:
        try:
            why = _agree(client, me, processes, ranks, job_id, use_shm, timeout_ms)
        except BaseException:
            # Cut short (an error, KeyboardInterrupt, a SystemExit from a
            # signal handler): the segment is dropped, its name removed.
            lib.cpu.host_segment_abandon()
            raise
    lib.cpu.host_segment_commit(me, why)
    with _lock:
        _missing = why or None


def _agree(client, me, processes, ranks, job_id, use_shm, timeout_ms) -> str:
    """Creates (process 0) or maps the segment, then learns whether every
    process has it. Returns "" when all do, else why not."""

    mine = "" if use_shm else TCP_ONLY
    if me == 0:
        record = {"error": mine}
        if use_shm:
            try:
                record = {"name": lib.cpu.host_segment_attach(job_id, me, processes, ranks, "")}
            except RuntimeError as e:
                mine = str(e)
                record = {"error": mine}
        client.key_value_set(_NAME_KEY, json.dumps(record))
        return _decide(client, processes, mine, timeout_ms)
    try:
        record = json.loads(client.blocking_key_value_get(_NAME_KEY, timeout_ms))
    except Exception as e:  # the client raises its own error types
        record = {"error": f"process 0 did not publish the host segment: {e}"}
    # A process with JAXRING_TRANSPORT=tcp keeps to sockets whatever
    # process 0 offers.
    if not mine and "name" in record:
        try:
            lib.cpu.host_segment_attach(job_id, me, processes, ranks, str(record["name"]))
        except RuntimeError as e:
            mine = str(e)
    elif not mine:
        mine = str(record.get("error", "no name"))
    client.key_value_set(_STATUS_KEY.format(me), mine or "ok")
    # Process 0 takes up to timeout_ms for every status; a decision that
    # still does not come means it is gone or stuck, and this process must
    # not guess: its guess could differ from what the others were told.
    try:
        decision = client.blocking_key_value_get(_DECISION_KEY, 2 * timeout_ms)
    except Exception as e:
        raise RuntimeError(
            "jaxring: process 0 did not say whether the job's processes share "
            f"the host segment within {2 * timeout_ms / 1000:g} s (is it "
            f"running the same program?): {e}"
        ) from e
    return "" if decision == "ok" else decision


def _decide(client, processes: int, mine: str, timeout_ms: int) -> str:
    """Process 0's decision for every process, published: "" (every
    process has the segment) or why not. It waits for the statuses under
    one deadline, so that it decides within timeout_ms of offering."""

    deadline = time.monotonic() + timeout_ms / 1000
    for q in range(1, processes):
        left_ms = max(1, int((deadline - time.monotonic()) * 1000))
        try:
            theirs = client.blocking_key_value_get(_STATUS_KEY.format(q), left_ms)
        except Exception as e:
            theirs = f"it did not say whether it mapped the segment: {e}"
        if theirs != "ok" and not mine:
            mine = f"process {q}: {theirs}"
    # Every process has mapped the segment or never will: its name goes now,
    # not after the decision's round trip.
    lib.cpu.host_segment_unlink()
    client.key_value_set(_DECISION_KEY, mine or "ok")
    return mine


def remove_stale() -> list[str]:
    """Removes from /dev/shm the host segments and links' rings that jobs
    of this user left when their creator was killed outright (SIGKILL, a
    crash): only those whose creator ran in this pid namespace and is gone.
    Returns their names."""

    return lib.cpu.shm_remove_stale_segments()


def unavailable() -> str | None:
    """Why algorithm="direct" cannot run across processes here, or None."""
    with _lock:
        return _missing
