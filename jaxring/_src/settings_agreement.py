"""The processes of one host agree, at the transport's set-up, on whether
their allreduces run direct over the host segment.

On one host "auto" runs direct over the host segment. A process whose
settings make it run the ring or the exchange instead (its own
JAXRING_ALGORITHM or JAXRING_TOPOLOGY, or a tuning table of another
choice) sends frames nobody reads while its peers wait in the segment for
it: both sides wait until timeout_s, since neither ever sees the other's
description. Disagreements between processes that both run a ring are
caught where they happen, by the descriptions their frames carry; this
one is caught here, before anything runs.

So where every process of the job is on one host and the host segment
may be used (no process forces JAXRING_TRANSPORT=tcp), each process
publishes with its transport record (distributed.py) whether an
allreduce over the job's devices, with nothing passed for it, runs direct
under its settings, resolved as jaxring.allreduce resolves them (the
settings, then the tuning table: whose choices are direct at every size
or at none, across processes), and compares that with the others'.
Values that choose alike (algorithm "direct" or "auto", two tables that
both take direct) agree. What is compared is the settings at the set-up,
the first allreduce across processes: per-call arguments and settings
changed later are the program's, which every process must run alike.
"""

from __future__ import annotations

import jax

from jaxring._src import choice, errors
from jaxring._src.config import config

# One size to look a tuning table up at: its choices are one family.
_ANY_SIZE = 1 << 20


def record() -> dict:
    """This process's choice, and the settings it comes from (for the
    message)."""
    tunable = choice.tunable_settings(rings=None, chunk_bytes=None, algorithm=None, topology=None)
    _, _, algorithm, topology, tabled = choice.tuned_settings(
        tunable,
        jax.device_count(),
        _ANY_SIZE,
        config.rings,
        config.chunk_bytes,
        config.algorithm,
        config.topology,
    )
    return {
        "runs direct": algorithm == "direct" or (algorithm == "auto" and topology == "auto"),
        "algorithm": str(config.algorithm),
        "topology": str(config.topology),
        "tuning": str(config.tuning)
        + (" (a table for this job)" if tabled else " (no table for this job)"),
    }


def check(mine: dict, theirs: dict, me: int, peer: int) -> None:
    """Raises MismatchError if process `peer`, on this process's host,
    chooses otherwise than this one."""
    if mine["runs direct"] == theirs.get("runs direct", mine["runs direct"]):
        return

    def said(r: dict) -> str:
        return (
            f"{'direct' if r['runs direct'] else 'the ring'} (algorithm "
            f"{r.get('algorithm')!r}, topology {r.get('topology')!r}, tuning "
            f"{r.get('tuning')!r})"
        )

    raise errors.MismatchError(
        f"jaxring: the processes of this host run with settings that choose "
        f"differently how an allreduce runs: process {peer} runs {said(theirs)}, "
        f"this process ({me}) {said(mine)}. A process that runs direct over the "
        f"shared segment and one that runs the ring would wait on each other "
        f"until the timeout. Give every process the same JAXRING_ALGORITHM and "
        f"JAXRING_TOPOLOGY (or jaxring.config values) and the same tuning file "
        f"(JAXRING_TUNING, by default ~/.cache/jaxring/tuning.json).",
        peer_process=peer,
    )
