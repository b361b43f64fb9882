# The public surface of jaxring._jaxring_cuda, written by
#   python -m nanobind.stubgen -m jaxring._jaxring_cuda
# with the build-dependent values of constants left out.
# tests/test_build.py checks that it names what the module has.
"""jaxring's CUDA backend: NCCL rings as XLA FFI custom calls"""

def registrations() -> dict:
    """FFI handler capsules by target name, for platform CUDA."""

def new_unique_id() -> bytes:
    """A fresh NCCL unique id (128 bytes); needs no GPU."""

UNIQUE_ID_BYTES: int

def set_process_index(index: int) -> None:
    """This process's index, to find its devices in the rank tables."""

def destroy_communicators() -> int:
    """Finalizes and destroys every cached NCCL communicator."""

def communicator_count() -> int:
    """NCCL communicators in the cache."""

def split_phase_pending() -> int:
    """Split-phase starts whose done has not run yet."""

def watched_count() -> int:
    """Ring operations the watchdog still follows (not finished yet)."""

def nccl_version() -> int:
    """The linked NCCL's version code (e.g. 23206 for 2.32.6)."""

NCCL_HEADER_VERSION: int

def cuda_runtime_version() -> int:
    """The CUDA runtime's version (e.g. 13000)."""

def device_count() -> int:
    """CUDA devices visible to this process (0 without a driver)."""

def reduce_on_device(elem_type: int, op: int, a: bytes, b: bytes) -> bytes:
    """a (op) b computed by the CUDA reduce kernel on device 0 (tests)."""

def time_reduce_and_copy(elem_type: int, nbytes: int, iters: int) -> tuple[float, float]:
    """(reduce seconds, device-to-device copy seconds) per call (benchmarks)."""
