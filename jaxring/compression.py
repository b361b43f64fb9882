"""Gradient compression that sums on the ring, as optax transformations.

Each transformation takes a rank's *local* gradients and returns their mean
over the data-parallel axis; chain it first and drop your own pmean::

    tx = optax.chain(jaxring.compression.powersgd("batch", rank=4),
                     optax.adam(1e-3))

Their allreduces are ordinary jaxring allreduces, so ``jaxring.overlap``
buckets them by readiness. Their error-feedback residuals are per-rank
state: see :func:`state_specs` and :func:`for_ranks` (shard_map), or
replicate the whole optimizer state per device (pmap). See
docs/compression.md.
"""

try:
    import optax  # noqa: F401
except ImportError:
    raise ImportError(
        "jaxring.compression makes optax transformations; "
        "install optax (pip install 'jaxring[compression]')"
    ) from None

from jaxring._src.compress_common import (
    CompressionReport,
    LeafPlan,
    for_ranks,
    rank_mask,
    report,
    state_specs,
)
from jaxring._src.compress_powersgd import PowerSGDState, powersgd
from jaxring._src.compress_wire16 import Wire16State, wire16

__all__ = [
    "CompressionReport",
    "LeafPlan",
    "PowerSGDState",
    "Wire16State",
    "for_ranks",
    "powersgd",
    "rank_mask",
    "report",
    "state_specs",
    "wire16",
]
