"""jaxring: chunked multi-ring allreduce for JAX, as XLA FFI custom calls.

Import jaxring before JAX starts its CPU backend: it sizes the CPU thread pool
so that collectives dispatched back to back cannot wedge it.
"""

try:
    from jaxring import _build_config as _bc
except ImportError:  # the C++ extension and its build record are made by pip
    raise ImportError(
        "jaxring's compiled extension is missing: Python found the source "
        "tree (the current directory?) rather than an installed build. Run "
        "`pip install .`, then use jaxring from outside the checkout, or "
        "through its commands (jaxring-bench) and `pytest tests`."
    ) from None

from jaxring._src import jax_compat as _jax_compat, runtime as _runtime

_jax_compat.warn_if_untested()
_runtime.check_huge_pages_setting()
_runtime.size_cpu_pool()

from jaxring._src import timeline as _timeline  # noqa: E402
from jaxring._src.allreduce import allreduce, pmean, psum  # noqa: E402
from jaxring._src.build_info import build_info  # noqa: E402
from jaxring._src.config import config  # noqa: E402
from jaxring._src.distributed import transport_info  # noqa: E402
from jaxring._src.errors import (  # noqa: E402
    CollectiveTimeoutError,
    JaxringError,
    MismatchError,
    PeerLostError,
    translate_errors,
)
from jaxring._src.jit_grad import value_and_grad  # noqa: E402
from jaxring._src.overlap import OverlapReport, OverlapWarning, explain, overlap  # noqa: E402
from jaxring._src.runtime import use_cpu_devices  # noqa: E402
from jaxring._src.timeline import timeline  # noqa: E402

_timeline.start_from_environment()

__version__ = _bc.VERSION


def __getattr__(name):
    # jaxring.compression needs optax, so it loads on first use.
    if name == "compression":
        import importlib

        return importlib.import_module("jaxring.compression")
    raise AttributeError(f"module 'jaxring' has no attribute {name!r}")


__all__ = [
    "CollectiveTimeoutError",
    "JaxringError",
    "MismatchError",
    "OverlapReport",
    "OverlapWarning",
    "PeerLostError",
    "allreduce",
    "build_info",
    "config",
    "explain",
    "overlap",
    "pmean",
    "psum",
    "timeline",
    "translate_errors",
    "transport_info",
    "use_cpu_devices",
    "value_and_grad",
]
