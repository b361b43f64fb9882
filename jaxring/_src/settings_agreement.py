"""The processes of one host agree, at the transport's set-up, on the
settings that choose between direct and the ring.

On one host "auto" runs direct over the host segment. A process whose
settings make it run the ring or the exchange for the same allreduce (its
own JAXRING_ALGORITHM or JAXRING_TOPOLOGY, or another tuning table) sends
frames nobody reads while its peers wait in the segment for it: both sides
wait until timeout_s, since neither ever sees the other's description.
Frames between processes that both run a ring carry their descriptions, so
those disagreements are caught where they happen; this one is caught here,
before anything runs.

Each process publishes these settings with its transport record
(distributed.py) and compares them with those of the processes that share
its host. They are the values at the set-up, the first allreduce across
processes: settings changed later, or per call, are the program's, which
every process must run alike anyway.
"""

from __future__ import annotations

import hashlib

from jaxring._src import errors

# What the host's processes must agree on, and where a user sets each.
_WHERE = {
    "algorithm": "JAXRING_ALGORITHM / jaxring.config.algorithm",
    "topology": "JAXRING_TOPOLOGY / jaxring.config.topology",
    "tuning table": ("the file JAXRING_TUNING / jaxring.config.tuning names "
                     "(by default ~/.cache/jaxring/tuning.json)"),
}


def tuning_table_digest(setting: str) -> str:
    """What the tuning table `setting` names holds: "off", "no file", or a
    digest of its bytes."""
    from jaxring._src import tuning
    if setting == "off":
        return "off"
    path = tuning.cache_path() if setting == "auto" else setting
    try:
        with open(path, "rb") as f:
            return "sha256 " + hashlib.sha256(f.read()).hexdigest()[:16]
    except OSError:
        return "no file"


def record(compare_tuning_tables: bool = True) -> dict:
    """This process's values of the settings in _WHERE. Without
    compare_tuning_tables (the tuner, which runs to replace tables that may
    differ, measuring with explicit settings) the table is left out."""
    from jaxring._src.config import config
    mine = {"algorithm": str(config.algorithm), "topology": str(config.topology)}
    if compare_tuning_tables:
        mine["tuning table"] = tuning_table_digest(str(config.tuning))
    return mine


def check(mine: dict, theirs: dict, me: int, peer: int) -> None:
    """Raises MismatchError if process `peer`, on this process's host, has
    other values than this one (a setting that either left out counts as
    agreed)."""
    for name, where in _WHERE.items():
        if name in mine and name in theirs and mine[name] != theirs[name]:
            raise errors.MismatchError(
                f"jaxring: the processes of this host run with different "
                f"settings that choose how an allreduce runs: {name} is "
                f"{theirs[name]!r} in process {peer} and {mine[name]!r} in this "
                f"process ({me}). On one host a process that runs direct over "
                f"the shared segment and one that runs the ring would wait on "
                f"each other until the timeout. Give every process the same "
                f"{where}.", peer_process=peer)
