"""The one door to jaxring's compiled extensions.

Modules that call into C++ import this one at their top and use ``lib.cpu``:
the ``_jaxring`` extension (the CPU backend, the transports, the timeline),
loaded once with the package. The CUDA extension is optional and needs the
CUDA runtime and NCCL to load, so it is loaded on first use: ``lib.cuda()``
returns it, or None where it cannot load (``lib.cuda_status()`` says why).
"""

from __future__ import annotations

import functools
import types

import jaxring._build_config as build_config
import jaxring._jaxring as cpu

__all__ = ["build_config", "cpu", "cuda", "cuda_status"]


@functools.cache
def _load_cuda() -> tuple[types.ModuleType | None, str]:
    if build_config.CUDA_STATUS != "built":
        return None, build_config.CUDA_STATUS
    try:
        import jaxring._jaxring_cuda as _jaxring_cuda
    except ImportError as e:
        return None, f"built but not loadable: {e}"
    return _jaxring_cuda, "built"


def cuda() -> types.ModuleType | None:
    """The CUDA extension, or None where it was not built or cannot load."""
    return _load_cuda()[0]


def cuda_status() -> str:
    """ "built", or why the CUDA extension is not available."""
    return _load_cuda()[1]
