"""Timeline: every transfer of the CPU transport as a Chrome/Perfetto trace.

One track per device; each allreduce (each bucket of ``jaxring.overlap``) is
a span from the moment that device started it to the moment its part
completed, named by its bucket and annotated with bytes and rings. Where
every rank of the allreduce runs in this process, its args also split the
span at the moment the last rank started it: ``waiting_for_peers_ms``
before, ``after_last_join_ms`` after (the transfers, and the link
emulation's wait). A long first part means the devices reach the
allreduce at different times, not that the link is slow. Open the file in
https://ui.perfetto.dev or chrome://tracing.

    with jaxring.timeline("trace.json"):
        for _ in range(3):
            state = train_step(state, batch)

or set ``JAXRING_TIMELINE=trace.json`` to record the whole process and write
the file at exit. Either path is checked before recording starts: one that
cannot be written raises OSError then (at ``import jaxring`` for the
variable), not when the trace is due.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import threading

from jaxring._src import lib

_lock = threading.Lock()
_names: dict[int, tuple[str, dict]] = {}  # op id -> (span name, extra args)
_events: list[tuple] = []
_host_spans: list[tuple[str, int, int]] = []  # (name, begin ns, end ns)
_recording = False
HOST_TRACK = -1


def name_op(op_id: int, name: str, **args) -> None:
    """Names the spans of op_id (called at trace or lowering time)."""
    with _lock:
        _names[int(op_id)] = (name, args)


def _collect() -> None:

    got = lib.cpu.timeline_take()
    with _lock:
        _events.extend(got)


@contextlib.contextmanager
def host_span(name: str):
    """Marks a span of host time (e.g. one step, dispatch to results) on the
    trace's host track, to compare with the transfers."""

    begin = lib.cpu.timeline_now_ns()
    try:
        yield
    finally:
        if _recording:
            with _lock:
                _host_spans.append((name, begin, lib.cpu.timeline_now_ns()))


def start() -> None:
    """Starts recording (events before this call are dropped)."""
    global _recording

    lib.cpu.timeline_take()
    with _lock:
        _events.clear()
        _host_spans.clear()
        _recording = True
    lib.cpu.timeline_enable(True)


def stop(path: str | os.PathLike) -> str:
    """Stops recording and writes the trace to path; returns path."""
    global _recording

    lib.cpu.timeline_enable(False)
    _collect()
    with _lock:
        _recording = False
        events = list(_events)
        names = dict(_names)
        spans = list(_host_spans)
    write(path, events, names, spans)
    return str(path)


def write(path, events, names, host_spans=()) -> None:
    trace = []
    devices = sorted({e[0] for e in events})
    for d in devices:
        trace.append(
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": d, "args": {"name": f"device {d}"}}
        )
    origin = min([e[5] for e in events] + [s[1] for s in host_spans], default=0)
    if host_spans:
        trace.append(
            {
                "name": "thread_name",
                "ph": "M",
                "pid": 0,
                "tid": HOST_TRACK,
                "args": {"name": "host"},
            }
        )
    for name, begin, end in host_spans:
        trace.append(
            {
                "name": name,
                "ph": "X",
                "pid": 0,
                "tid": HOST_TRACK,
                "ts": (begin - origin) / 1e3,
                "dur": (end - begin) / 1e3,
            }
        )
    for device, run_id, op_id, nbytes, rings, begin, end, peers in events:
        name, extra = names.get(op_id, (f"allreduce op {op_id}", {}))
        args = {"bytes": nbytes, "rings": rings, "op_id": op_id, "run_id": run_id}
        if peers >= 0:  # -1: some ranks run in other processes
            peers = min(max(peers, begin), end)
            args["waiting_for_peers_ms"] = (peers - begin) / 1e6
            args["after_last_join_ms"] = (end - peers) / 1e6
        trace.append(
            {
                "name": name,
                "ph": "X",
                "pid": 0,
                "tid": device,
                "ts": (begin - origin) / 1e3,
                "dur": max(end - begin, 0) / 1e3,
                "args": {**args, **extra},
            }
        )
    with open(path, "w") as f:
        json.dump({"traceEvents": trace, "displayTimeUnit": "ms"}, f)


def check_writable(path: str | os.PathLike, given_as: str) -> None:
    """Raises OSError, naming the path and the reason, where a trace could
    not be written to path: checked before recording, so that a typo in the
    path fails at once rather than when the trace is written (at the end of
    the block, or at exit). given_as: how the caller passed the path.

    Opens the file for appending, which creates nothing lasting: a file
    this made is removed again."""
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        parent = os.path.dirname(os.path.abspath(path))
        reason = (
            f"the directory {parent!r} does not exist"
            if isinstance(e, FileNotFoundError)
            else e.strerror or str(e)
        )
        raise type(e)(
            f"{given_as}: cannot write the timeline to {os.fspath(path)!r}: "
            f"{reason}. Name a file in a directory that exists and that this "
            "process may write to"
        ) from e
    if not existed:
        os.remove(path)


@contextlib.contextmanager
def timeline(path: str | os.PathLike):
    """Records the transfers made inside the block and writes them to path.

    Results must be ready when the block ends (``jax.block_until_ready``) for
    their transfers to be in the file. A path that cannot be written raises
    OSError before the block runs.
    """
    check_writable(path, f"jaxring.timeline({os.fspath(path)!r})")
    start()
    try:
        yield
    finally:
        stop(path)


def start_from_environment() -> None:
    path = os.environ.get("JAXRING_TIMELINE")
    if not path:
        return
    # Written at exit, perhaps after the program changed directory: the
    # file checked now is the file written then.
    path = os.path.abspath(path)
    check_writable(path, f"JAXRING_TIMELINE={os.environ['JAXRING_TIMELINE']!r}")
    start()
    atexit.register(stop, path)
