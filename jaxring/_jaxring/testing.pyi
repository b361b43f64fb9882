# The jaxring._jaxring.testing submodule, written with its parent's stub
# (see __init__.pyi).
"""Counters of operations still held, for jaxring's tests."""

def inprocess_pending_ops() -> int:
    """
    Operations the in-process transport (and its tiered plans' host) still holds.
    """

def gang_start_pending() -> int:
    """Split-phase starts still gathering their in-process ranks."""

def split_phase_unfinished_starts() -> int:
    """Split-phase allreduces started and not yet finished."""

def split_phase_pooled_bytes() -> int:
    """Bytes of released split-phase buffers kept for reuse."""
