"""What this installation of jaxring was built with."""

from __future__ import annotations

from jaxring._src import cuda_backend, jax_compat, lib


def build_info() -> dict:
    """Version, the jax/jaxlib versions built and run with, and which
    backends were compiled.

    ``built_with_jaxlib`` and ``ffi_api`` name the XLA FFI headers the
    handlers were compiled against (a handler loads on that jaxlib and every
    newer one); ``jax`` and ``jaxlib`` are the versions running now, and
    ``jax_tested`` says whether they lie in ``tested_jax``, the range jaxring
    is tested on.

    Example:
        >>> jaxring.build_info()["backends"]["cpu"]
        True
    """
    import jax
    import jaxlib

    cuda_status = cuda_backend.status()
    info = {
        "version": lib.build_config.VERSION,
        "built_with_jaxlib": lib.build_config.BUILT_WITH_JAXLIB,
        "ffi_api": lib.build_config.FFI_API_VERSION,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "tested_jax": jax_compat.SUPPORTED_JAX_TEXT,
        "jax_tested": jax_compat.in_tested_range(),
        "backends": {"cpu": hasattr(lib.cpu, "registrations"), "cuda": cuda_status == "built"},
        "cuda": cuda_status,
        # What authenticates the TCP transport's peers (None: not built in,
        # and the transport refuses to start).
        "tcp_auth": lib.cpu.tcp_auth_library() or None,
    }
    if cuda_status == "built":
        cuda = lib.cuda()
        info["nccl"] = _nccl_version_string(cuda.nccl_version())
        info["nccl_headers"] = _nccl_version_string(cuda.NCCL_HEADER_VERSION)
        info["cuda_runtime"] = cuda.cuda_runtime_version()
    return info


def _nccl_version_string(code: int) -> str:
    """NCCL's version code (major*10000 + minor*100 + patch) as "2.32.6"."""
    return f"{code // 10000}.{code // 100 % 100}.{code % 100}"
