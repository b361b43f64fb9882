"""Across processes: which process runs each rank, and the TCP transport's
set-up through jax.distributed's key-value store.

Under multi-controller JAX (``jax.distributed.initialize``) every process
lowers the same program. When a ring's ranks live in different processes the
custom call carries a table of the process of each rank, and the C++ side
moves that ring's chunks over TCP. Each process opens a listening socket,
publishes ``host:port`` under a jaxring key of the coordinator's key-value
store and reads everyone else's: there is nothing for users to configure.
The first cross-process lowering does this, so it works whether jaxring was
imported before or after ``jax.distributed.initialize``.

A peer is let in only after it proved, by an HMAC handshake
(``xla_ffi/cpu/net/tcp_handshake.h``), that it holds the job's secret and the
job's id. The secret comes from ``JAXRING_JOB_SECRET`` when set (the
launcher always sets one); otherwise process 0 makes one and shares it
through the key-value store, which is then only as private as the
coordinator's port. Process 0 makes the job id for every job.

Processes on one host move their data through shared-memory rings
(``xla_ffi/cpu/net/shm_link.h``) instead of TCP loopback. Which processes share
a host is read from the records they publish (the kernel's boot id and the
device of ``/dev/shm``), and then proved per connection: the receiver must
map the segment the sender made, or the two use TCP. ``JAXRING_TRANSPORT``
picks: ``auto`` (default) or ``tcp`` (TCP between every two processes, for
comparison).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import re
import secrets
import socket
import string
import threading

import numpy as np

from jaxring._src import crowding, host_segment, jax_compat, lib, settings_agreement

_PREFIX = "jaxring/tcp/v2/"
_ADDRESS_KEY = _PREFIX + "address/{}"
_JOB_KEY = _PREFIX + "job"
SECRET_ENV = "JAXRING_JOB_SECRET"
TRANSPORT_ENV = "JAXRING_TRANSPORT"
TRANSPORTS = ("auto", "tcp")
HOST_ID_ENV = "JAXRING_HOST_ID"
SOCKET_BUFFER_ENV = "JAXRING_TCP_SOCKET_BUFFER"
# Linux doubles what it is given and keeps at least about 4.5 KiB; above
# 1 GiB is a typo, not a tuning.
_SOCKET_BUFFER_RANGE = (4096, 1 << 30)
_lock = threading.Lock()
_ready = False
# The message of a set-up that failed, raised again by every later call.
_setup_failure: str | None = None
_hosts: dict[int, str] = {}
_secret_source = ""
# The fewest cores per rank over the job's machines (crowding.py), from the
# records every process published; inf until the transport is set up.
_cores_per_rank = math.inf


def secret_from_env(environ=os.environ) -> bytes | None:
    """JAXRING_JOB_SECRET as bytes, None if unset; ValueError naming the
    variable if it cannot be a secret of at least 128 bits."""
    text = environ.get(SECRET_ENV)
    if text is None:
        return None
    text = text.strip()
    if not re.fullmatch(r"(?:[0-9a-fA-F]{2}){16,512}", text):
        raise ValueError(
            f"{SECRET_ENV} must be 32 to 1024 hexadecimal digits, an even "
            f"number of them (at least 128 bits); it holds "
            f"{_secret_faults(text)}. Set it to the output of "
            f"`python -c 'import secrets; print(secrets.token_hex(32))'`, the "
            f"same in every process, or unset it"
        )
    return bytes.fromhex(text)


def _secret_faults(text: str) -> str:
    """What keeps text from being a job secret, without quoting any of it."""
    out = f"{len(text)} characters"
    if len(text) < 32:
        out += " (fewer than 32)"
    elif len(text) > 1024:
        out += " (more than 1024)"
    elif len(text) % 2:
        out += " (an odd number)"
    bad = [i for i, c in enumerate(text, 1) if c not in string.hexdigits]
    if bad:
        where = ", ".join(map(str, bad[:5])) + (", ..." if len(bad) > 5 else "")
        out += f", of which {len(bad)} (at position {where}) " + (
            "is not a hexadecimal digit" if len(bad) == 1 else "are not hexadecimal digits"
        )
    return out


def new_secret_hex() -> str:
    """A fresh job secret (256 bits) in the form JAXRING_JOB_SECRET takes."""
    return secrets.token_hex(32)


def secret_fingerprint(secret: bytes, job_id: bytes) -> str:
    """Says whether two processes hold the same secret without saying what
    it is (an HMAC under the secret itself)."""
    return hmac.new(secret, b"jaxring secret fingerprint" + job_id, hashlib.sha256).hexdigest()[:32]


def device_assignment(axis_ctx) -> tuple | None:
    """The devices of a lowering in partition-id order, if known."""
    devices = getattr(axis_ctx, "device_assignment", None)
    if devices:
        return tuple(devices)
    try:
        mesh_devices = getattr(getattr(axis_ctx, "mesh", None), "devices", None)
    except ValueError:  # an AbstractMesh: it has no devices
        return None
    if mesh_devices is None:
        return None
    return tuple(np.asarray(mesh_devices).flat)


def process_table(
    devices, rank_table: np.ndarray, group_table: np.ndarray, world: int
) -> np.ndarray:
    """process_of[group * world + rank] for every (group, rank) of the rings.

    rank_table and group_table map a partition id to its rank and group.
    """
    groups = int(group_table.max()) + 1 if len(group_table) else 1
    table = np.zeros(groups * world, np.int64)
    for pid, dev in enumerate(devices):
        table[int(group_table[pid]) * world + int(rank_table[pid])] = dev.process_index
    return table


def _local_host(coordinator: str | None) -> str:
    """The address peers should use to reach this process.

    JAXRING_TCP_HOST wins; otherwise the local address of the route to the
    coordinator (no packet is sent: connecting a UDP socket only picks the
    route), which is the interface the job already uses.
    """
    explicit = os.environ.get("JAXRING_TCP_HOST")
    if explicit:
        return explicit
    if coordinator:
        host = coordinator.rsplit(":", 1)[0].strip("[]")
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((host, 9))
                return s.getsockname()[0]
        except OSError:
            pass
    return socket.gethostbyname(socket.gethostname())


def transport_choice() -> str:
    """JAXRING_TRANSPORT, checked: "auto" (the default) or "tcp"."""
    choice = os.environ.get(TRANSPORT_ENV, "auto").strip().lower() or "auto"
    if choice not in TRANSPORTS:
        raise ValueError(
            f"jaxring: {TRANSPORT_ENV}={os.environ[TRANSPORT_ENV]!r} "
            "is not one of auto, tcp (auto: shared memory between processes "
            "on one host, TCP between hosts; tcp: TCP everywhere)"
        )
    return choice


def socket_buffer_choice() -> int:
    """JAXRING_TCP_SOCKET_BUFFER, checked: the SO_SNDBUF and SO_RCVBUF of
    every connection in bytes, or 0 (unset: the kernel's autotuning)."""
    raw = os.environ.get(SOCKET_BUFFER_ENV, "").strip()
    if not raw:
        return 0
    low, high = _SOCKET_BUFFER_RANGE
    # ASCII digits only: str.isdigit also takes characters such as "²".
    value = int(raw) if raw.isascii() and raw.isdigit() else -1
    if not low <= value <= high:
        raise ValueError(
            f"jaxring: {SOCKET_BUFFER_ENV}={raw!r} is not a whole number of "
            f"bytes from {low} to {high} (unset it to leave the buffers to "
            f"the kernel)"
        )
    return value


def host_identity() -> str:
    """What processes that can share memory have in common: the running
    kernel (its boot id), the file system behind /dev/shm, and
    JAXRING_HOST_ID where set (distinct values keep processes of one
    machine apart, as emulated hosts must be). Equal records only make two
    processes try a shared-memory ring; the ring itself proves that they
    can (a container with a /dev/shm of its own fails to map the other's
    segment, and the two use TCP)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            kernel = f.read().strip()
    except OSError:
        kernel = socket.gethostname()
    try:
        shm = str(os.stat("/dev/shm").st_dev)
    except OSError:
        shm = "none"
    return f"{kernel}/{shm}/{os.environ.get(HOST_ID_ENV, '')}"


def _job_secret_and_id(client, me: int, timeout_ms: int) -> tuple[bytes, bytes, str]:
    """The job's secret, its id, and where the secret came from.

    Process 0 publishes the job id, and the secret too when it has none from
    the environment; every process must then agree on whether the
    environment gives it one.
    """
    env_secret = secret_from_env()
    if me == 0:
        record = {"job_id": secrets.token_hex(16)}
        if env_secret is None:
            record["secret"] = new_secret_hex()
        client.key_value_set(_JOB_KEY, json.dumps(record))
    else:
        try:
            record = json.loads(client.blocking_key_value_get(_JOB_KEY, timeout_ms))
        except Exception as e:  # the client raises its own error types
            raise RuntimeError(
                f"jaxring: process 0 did not publish the TCP transport's job "
                f"record within {timeout_ms / 1000} s (is it running the same "
                f"program?): {e}"
            ) from e
    job_id = bytes.fromhex(record["job_id"])
    if env_secret is not None:
        if "secret" in record:
            raise RuntimeError(
                f"jaxring: {SECRET_ENV} is set in this process ({me}) but not "
                f"in process 0; set it in every process of the job or in none"
            )
        return env_secret, job_id, "environment"
    if "secret" not in record:
        raise RuntimeError(
            f"jaxring: process 0 has {SECRET_ENV} set but this process ({me}) "
            f"does not; set it in every process of the job or in none"
        )
    return bytes.fromhex(record["secret"]), job_id, "key-value store"


def ensure_tcp_transport(timeout_s: float, check_settings: bool = True) -> None:
    """Sets up the TCP transport once per process (blocks until every
    process has published its address, at most timeout_s). With
    check_settings, raises MismatchError where the processes of a job on
    one host would choose differently between direct and the ring
    (settings_agreement.py).

    A set-up that failed is not tried again: its keys are published once
    per job (a second try would meet its own), and the job's processes
    would no longer agree on the job record. Every later call raises the
    first failure instead."""
    global _setup_failure

    with _lock:
        if _ready:
            return
        if jax_compat.distributed_client() is None:
            raise RuntimeError(
                "jaxring.allreduce: the ring's devices belong to several "
                "processes but jax.distributed is not initialized in this one; "
                "call jax.distributed.initialize() first (or start the job "
                "with `python -m jaxring.launch`)."
            )
        if _setup_failure is not None:
            raise RuntimeError(
                "jaxring: the TCP transport's set-up failed earlier in this "
                "process and is not tried again (restart the job); the first "
                f"failure: {_setup_failure}"
            )
        try:
            _set_up_tcp_transport(timeout_s, check_settings)
        except Exception as e:
            _setup_failure = str(e)
            raise


def _set_up_tcp_transport(timeout_s: float, check_settings: bool) -> None:
    """ensure_tcp_transport's work, under its lock."""
    global _ready, _secret_source, _cores_per_rank
    import jax

    client = jax_compat.distributed_client()
    me, n, coordinator = jax_compat.distributed_state()
    timeout_ms = int(timeout_s * 1000)
    use_shm = transport_choice() == "auto"
    lib.cpu.tcp_set_socket_buffer(socket_buffer_choice())
    if use_shm:
        # Before this job makes segments of its own: what jobs killed
        # outright left would take the room this one needs.
        host_segment.remove_stale()
    my_host = host_identity()
    secret, job_id, source = _job_secret_and_id(client, me, timeout_ms)
    host = _local_host(coordinator)
    # The shared-memory choice goes with the listener: a peer may connect
    # and offer a ring before this process has every address.
    port = lib.cpu.tcp_listen(host, me, n, secret, job_id, use_shm)
    address = f"{host}:{port}" if ":" not in host else f"[{host}]:{port}"
    mine = secret_fingerprint(secret, job_id)
    my_settings = settings_agreement.record() if check_settings else None
    client.key_value_set(
        _ADDRESS_KEY.format(me),
        json.dumps(
            {
                "address": address,
                "secret_fingerprint": mine,
                "host": my_host,
                "shm": use_shm,
                "settings": my_settings,
                **crowding.local_record(jax.local_device_count()),
            }
        ),
    )
    addresses = []
    same_host = []
    records = []
    for q in range(n):
        try:
            record = json.loads(client.blocking_key_value_get(_ADDRESS_KEY.format(q), timeout_ms))
        except Exception as e:  # the client raises its own error types
            raise RuntimeError(
                f"jaxring: process {q} did not publish its TCP address "
                f"within {timeout_s} s (is it running the same program?): "
                f"{e}"
            ) from e
        if record["secret_fingerprint"] != mine:
            raise RuntimeError(
                f"jaxring: process {q} holds another {SECRET_ENV} than "
                f"this process ({me}); every process of a job needs the "
                f"same one"
            )
        addresses.append(record["address"])
        records.append(record)
        if q != me and record.get("host") == my_host:
            same_host.append(q)
    # Where direct may run across the processes (one host, no process that
    # keeps to TCP: the segment's own set-up below decides alike), they must
    # all choose it or none. Every process compares, so all raise or none.
    if (
        my_settings is not None
        and len(same_host) == n - 1
        and all(records[q].get("shm") for q in range(n))
    ):
        for q in same_host:
            if records[q].get("settings") is not None:
                settings_agreement.check(my_settings, records[q]["settings"], me, q)
    lib.cpu.tcp_set_peers(addresses, same_host)
    host_segment.set_up(
        client,
        me,
        n,
        jax.device_count(),
        job_id,
        one_host=len(same_host) == n - 1,
        use_shm=use_shm,
        timeout_ms=timeout_ms,
    )
    _secret_source = source
    _cores_per_rank = crowding.cores_per_rank(records)
    for q, a in enumerate(addresses):
        _hosts[q] = a.rsplit(":", 1)[0].strip("[]")
    _ready = True


def transport_info() -> dict:
    """This process's view of jaxring's TCP transport between processes.

    Returns a dict with ``listening`` (False until the first allreduce that
    spans processes set the transport up), ``address`` (``host:port`` that
    peers connect to: the port to open in a firewall), ``process`` and
    ``processes``, ``job_id`` (hex: the id process 0 made for this job,
    which every handshake covers), ``protocol_version``,
    ``authentication`` (the library
    that checks peers, e.g. ``"OpenSSL 3.0.19 ..."``, or ``None`` in a build
    without it), ``secret_source`` (``"environment"`` or
    ``"key-value store"``), ``inbound`` and ``outbound`` (the authenticated
    connections as ``(process, channel)`` pairs; a channel is a ring),
    ``lost_processes``, ``refused_connections`` with ``last_refusal`` (why
    the last stranger was turned away), ``pending_ops``, and
    ``data_frames``: how many data frames this process has sent, by the
    thread that wrote them, ``{"device_thread": n, "sender_thread": m}`` (a
    device's own thread writes a frame when nothing is queued before it on
    its connection and the socket, or the shared-memory ring, takes it at
    once; a connection's sender thread writes the rest), and
    ``"finished_by_sender_thread"``: the frames a device's thread began
    and the sender thread finished (the socket took part of one, or a
    ring's payload went in but not all of its header). ``socket_buffer``:
    the socket buffer size ``JAXRING_TCP_SOCKET_BUFFER`` set (``None``: the
    kernel's autotuning). The
    shared-memory links: ``transport`` (``"auto"`` or ``"tcp"``, from
    ``JAXRING_TRANSPORT``), ``same_host`` (the processes whose records say
    they share this host), ``shm_inbound`` and ``shm_outbound`` (the
    connections whose data goes through a shared-memory ring) and
    ``shm_unavailable`` (why a ring could not be made or mapped here, if
    one could not). ``cores_per_rank``: the fewest cores per rank over the
    job's machines, from the records every process published (``None``
    before the set-up); below 2, an allreduce across processes whose ring
    count was left to the default runs one ring. ``host_direct``: whether
    ``algorithm="direct"`` can run across this job's processes over the
    host segment (``available``; where not, ``unavailable`` says why), its
    ``chunk_bytes``, and ``pending_ops``.

    Example:
        >>> jaxring.transport_info()["listening"]
        False
    """

    raw = lib.cpu.tcp_transport_info()
    host = raw["host"]
    with _lock:
        source = _secret_source
        cores = _cores_per_rank
    address = None
    if raw["listening"]:
        address = f"[{host}]:{raw['port']}" if ":" in host else f"{host}:{raw['port']}"
    return {
        "listening": raw["listening"],
        "address": address,
        "process": raw["process"] if raw["listening"] else None,
        "processes": raw["processes"] if raw["listening"] else None,
        "job_id": raw["job_id"].hex() if raw["listening"] else None,
        "protocol_version": raw["protocol_version"],
        "authentication": raw["auth_library"] or None,
        "secret_source": source or None,
        "inbound": sorted(tuple(x) for x in raw["inbound"]),
        "outbound": sorted(tuple(x) for x in raw["outbound"]),
        "lost_processes": sorted(raw["lost_processes"]),
        "refused_connections": raw["refused_connections"],
        "last_refusal": raw["last_refusal"] or None,
        "pending_ops": raw["pending_ops"],
        "transport": ("auto" if raw["use_shm"] else "tcp") if raw["listening"] else None,
        "same_host": sorted(raw["same_host"]),
        "shm_inbound": sorted(tuple(x) for x in raw["shm_inbound"]),
        "shm_outbound": sorted(tuple(x) for x in raw["shm_outbound"]),
        "shm_unavailable": raw["shm_unavailable"] or None,
        "data_frames": {
            "device_thread": raw["data_frames_by_device_thread"],
            "sender_thread": raw["data_frames_by_sender_thread"],
            "finished_by_sender_thread": raw["data_frames_finished_by_sender_thread"],
        },
        "socket_buffer": (raw["socket_buffer"] or None) if raw["listening"] else None,
        "cores_per_rank": cores if raw["listening"] and cores != math.inf else None,
        "host_direct": _host_direct_info(),
    }


def _host_direct_info() -> dict:
    """transport_info()["host_direct"]."""

    raw = lib.cpu.host_segment_info()
    return {
        "available": raw["available"],
        "unavailable": host_segment.unavailable(),
        "chunk_bytes": raw["chunk_bytes"] or None,
        "pending_ops": raw["pending_ops"],
    }


def default_rings_across_processes(configured: int) -> int:
    """The ring count of an allreduce across processes whose count was left
    to the default `configured`: one ring on a crowded job (crowding.py).
    Called once the transport is set up, whose records it reads."""
    with _lock:
        cores = _cores_per_rank
    return crowding.rings_for(configured, cores)


def process_hosts() -> dict[int, str]:
    """The host address of every process, once the TCP transport is set up
    (processes that share one are on one host); empty before."""
    with _lock:
        return dict(_hosts)
