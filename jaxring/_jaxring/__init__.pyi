# The public surface of jaxring._jaxring, written by
#   python -m nanobind.stubgen -r -m jaxring._jaxring
# with the build-dependent values of constants left out.
# tests/test_build.py checks that it names what the module has.
"""jaxring C++ core: XLA FFI handlers and the ring plans."""

from collections.abc import Sequence

from . import testing as testing

def registrations() -> dict: ...

class RingPlan:
    """A chunked multi-ring allreduce schedule."""

    def __init__(
        self, world_size: int, rings: int, count: int, elem_bytes: int, chunk_bytes: int
    ) -> None: ...
    @property
    def world_size(self) -> int: ...
    @property
    def rings(self) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def elem_bytes(self) -> int: ...
    @property
    def chunk_elems(self) -> int: ...
    @property
    def num_steps(self) -> int: ...
    def order(self, ring: int) -> list[int]: ...
    def part(self, ring: int) -> tuple: ...
    def num_chunks(self, ring: int) -> int: ...
    def bytes_sent(self, rank: int) -> int: ...
    def transfers(self) -> list: ...
    def __repr__(self) -> str: ...

class TieredPlan:
    """
    A multi-dimensional chunked multi-ring allreduce schedule over a topology d0 x d1 x ... (tightest tier first).
    """

    def __init__(
        self,
        dims: Sequence[int],
        rings: int,
        count: int,
        elem_bytes: int,
        chunk_bytes: int,
        exchange: bool = False,
    ) -> None:
        """
        exchange=True: the exchange shape (recursive doubling) over dims, as exchange_tiers(world) gives them for algorithm='exchange'.
        """

    @property
    def exchange(self) -> bool: ...
    @property
    def dims(self) -> list[int]: ...
    @property
    def world_size(self) -> int: ...
    @property
    def rings(self) -> int: ...
    @property
    def count(self) -> int: ...
    @property
    def elem_bytes(self) -> int: ...
    @property
    def chunk_elems(self) -> int: ...
    @property
    def num_phases(self) -> int: ...
    def phase(self, phase: int) -> dict: ...
    def coord(self, rank: int, tier: int) -> int: ...
    def group(self, ring: int, phase: int, rank: int) -> list[int]: ...
    def shard(self, ring: int, phase: int, rank: int) -> tuple: ...
    def num_units(self, ring: int, phase: int, rank: int) -> int: ...
    def recv_span(self, ring: int, phase: int, rank: int, unit: int) -> tuple: ...
    def send_span(self, ring: int, phase: int, rank: int, unit: int) -> tuple: ...
    def bytes_sent(self, rank: int, tier: int) -> int: ...
    def transfers(self) -> list: ...
    def __repr__(self) -> str: ...

def exchange_tiers(world_size: int) -> list[int]:
    """The tiers algorithm='exchange' runs over world_size ranks."""

def close_handshakes(timeout_s: float) -> bool:
    """
    Refuses TCP handshakes from now on (at exit) and waits for the calls into OpenSSL in flight; false if some were still running.
    """

def wait_for_completions(timeout_s: float) -> bool:
    """Waits until no transport thread is completing an XLA future."""

def timeline_enable(on: bool) -> None:
    """Starts or stops recording the transport's timeline."""

def timeline_now_ns() -> int:
    """The timeline's clock (steady, ns)."""

def timeline_take() -> list[tuple[int, int, int, int, int, int, int, int]]:
    """Events recorded since the last call, as tuples."""

def tcp_listen(
    bind_host: str, process: int, processes: int, secret: bytes, job_id: bytes, use_shm: bool
) -> int:
    """
    Opens this process's listening socket for one job (its peers must prove the same secret and job id); returns its port. use_shm: whether shared-memory links with processes on this host are offered and taken.
    """

def tcp_set_socket_buffer(bytes: int) -> None:
    """
    SO_SNDBUF and SO_RCVBUF of every TCP transport socket opened from now on, in bytes; 0: the kernel's autotuning.
    """

def tcp_set_peers(addresses: Sequence[str], same_host: Sequence[int]) -> None:
    """Sets every process's host:port, and the processes on this host."""

def tcp_transport_info() -> dict:
    """The TCP transport's state, for jaxring.transport_info()."""

def tcp_auth_library() -> str:
    """The library that authenticates TCP peers, or '' if none was built in."""

def host_segment_attach(job_id: bytes, process: int, processes: int, ranks: int, name: str) -> str:
    """
    Creates (name '') or maps the host segment; returns its name. It is used once host_segment_commit says every process of the host has it.
    """

def host_segment_commit(process: int, missing: str) -> None:
    """
    Ends the host segment's set-up: with missing == '' it is used, else dropped, and missing says why direct across processes is unavailable.
    """

def host_segment_unlink() -> None:
    """
    Removes the name of the host segment being set up, if this process created it (once every process said whether it mapped it). The mapping stays.
    """

def host_segment_abandon() -> None:
    """
    Drops the host segment being set up (its set-up was cut short): the name is removed where this process created it. Committed segments are not affected.
    """

def shm_remove_stale_segments() -> list[str]:
    """
    Removes from /dev/shm the host segments and link rings of this user whose creator (in this pid namespace) is gone; returns their names.
    """

def host_segment_info() -> dict:
    """The host segment's state, for jaxring.transport_info()."""

def reduce_bytes(arg0: int, arg1: int, arg2: bytes, arg3: bytes, /) -> bytes: ...

REDUCE_OPS: dict

ALGORITHMS: dict

ELEM_TYPES: dict

built_with_jaxlib: str
