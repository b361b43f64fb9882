"""What this installation of jaxring was built with."""

from __future__ import annotations


def build_info() -> dict:
    """Version, the jax/jaxlib versions, and which backends were compiled.

    Example:
        >>> jaxring.build_info()["backends"]["cpu"]
        True
    """
    import jax
    import jaxlib

    from jaxring import _build_config, _jaxring
    cuda_status = _build_config.CUDA_STATUS
    return {
        "version": _build_config.VERSION,
        "built_with_jaxlib": _build_config.BUILT_WITH_JAXLIB,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "backends": {"cpu": hasattr(_jaxring, "registrations"),
                     "cuda": cuda_status == "built"},
        "cuda": cuda_status,
    }
