"""The host segment: the shared memory on which algorithm="direct" runs
across the processes of a job that all run on one host
(xla_ffi/cpu/host_segment.h).

Set up once, with the TCP transport, through the job's key-value store:
process 0 creates the segment and publishes its name, every other process
maps it and publishes whether it could, and process 0 publishes the
decision every process follows: the segment is used only if every process
mapped it. Every process then removes the name from its view (process 0
from /dev/shm)."""

from __future__ import annotations

import json
import threading

_PREFIX = "jaxring/host_segment/v1/"
_NAME_KEY = _PREFIX + "name"
_STATUS_KEY = _PREFIX + "status/{}"
_DECISION_KEY = _PREFIX + "decision"

_lock = threading.Lock()
_missing: str | None = "the transport between processes is not set up yet"


def set_up(client, me: int, processes: int, ranks: int, job_id: bytes,
           one_host: bool, use_shm: bool, timeout_ms: int) -> None:
    """Makes the host segment available to this process, or records why
    not. Every process of the job calls it, with the same one_host and
    use_shm (both come from records every process read)."""
    global _missing
    from jaxring import _jaxring
    if not use_shm:
        why = "JAXRING_TRANSPORT=tcp keeps every byte between processes on sockets"
    elif not one_host:
        why = "the job's processes run on more than one host"
    else:
        why = _attach_everywhere(client, me, processes, ranks, job_id, timeout_ms)
    _jaxring.host_segment_commit(me, why)
    with _lock:
        _missing = why or None


def _attach_everywhere(client, me, processes, ranks, job_id, timeout_ms) -> str:
    """Creates (process 0) or maps the segment, then learns whether every
    process has it. Returns "" when all do, else why not."""
    from jaxring import _jaxring
    mine = ""
    if me == 0:
        try:
            name = _jaxring.host_segment_attach(job_id, me, processes, ranks, "")
            client.key_value_set(_NAME_KEY, json.dumps({"name": name}))
        except RuntimeError as e:
            mine = str(e)
            client.key_value_set(_NAME_KEY, json.dumps({"error": mine}))
    else:
        try:
            record = json.loads(client.blocking_key_value_get(_NAME_KEY, timeout_ms))
        except Exception as e:  # the client raises its own error types
            record = {"error": f"process 0 did not publish the host segment: {e}"}
        if "name" in record:
            try:
                _jaxring.host_segment_attach(job_id, me, processes, ranks,
                                             str(record["name"]))
            except RuntimeError as e:
                mine = str(e)
        else:
            mine = str(record.get("error", "no name"))
    if me != 0:
        client.key_value_set(_STATUS_KEY.format(me), mine or "ok")
        try:
            decision = client.blocking_key_value_get(_DECISION_KEY, timeout_ms)
            return "" if decision == "ok" else decision
        except Exception as e:
            return f"process 0 did not publish whether the host segment is used: {e}"
    # Process 0 decides for everyone, so that no process runs direct while
    # another refuses it (each would otherwise judge the others' answers
    # under its own timeout).
    for q in range(1, processes):
        try:
            theirs = client.blocking_key_value_get(_STATUS_KEY.format(q), timeout_ms)
        except Exception as e:
            theirs = f"it did not say whether it mapped the segment: {e}"
        if theirs != "ok" and not mine:
            mine = f"process {q}: {theirs}"
    client.key_value_set(_DECISION_KEY, mine or "ok")
    return mine


def unavailable() -> str | None:
    """Why algorithm="direct" cannot run across processes here, or None."""
    with _lock:
        return _missing
