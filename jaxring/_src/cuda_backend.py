"""The CUDA backend from Python: loading ``jaxring._jaxring_cuda``,
registering its FFI target for the CUDA platform, and the NCCL unique ids
that name its communicators.

A communicator exists per (group of devices, ring). Its unique id is made
once per process for that key and cached, so every lowering of an allreduce
over the same devices reuses the same communicators. Across processes the
process of the group's rank 0 makes the id and publishes it under a jaxring
key of jax.distributed's key-value store; the others read it, waiting at
most the operation's timeout. The ids travel to the C++ handler as an
attribute of the custom call (128 bytes each, as 16 int64), beside the
device ordinal of each rank (rank_device).
"""

from __future__ import annotations

import atexit
import base64
import hashlib
import threading
from collections.abc import Sequence

import numpy as np

from jaxring._src import jax_compat, lib, runtime

_KEY = "jaxring/nccl/v1/{}/{}"
_ID_WORDS = 16  # NCCL_UNIQUE_ID_BYTES / 8

_lock = threading.Lock()
_id_lock = threading.Lock()
_ids: dict[tuple, bytes] = {}
_registered = False


def _module():
    return lib.cuda()


def status() -> str:
    """ "built", or why the CUDA backend is not available."""
    return lib.cuda_status()


def require(what: str):
    """The loaded CUDA module, or a NotImplementedError that says why not."""
    module = _module()
    if module is None:
        raise NotImplementedError(
            f"{what} on GPU needs jaxring's CUDA backend, which is "
            f"{status()}. Rebuild jaxring where nvcc and NCCL are found "
            "(see docs/gpu.md), or use lax.psum on GPUs."
        )
    return module


def register() -> None:
    """Registers the CUDA FFI target and the exit hook, once per process."""
    global _registered
    with _lock:
        if _registered:
            return
        import jax

        module = require("jaxring.allreduce")
        runtime.register_targets(module.registrations(), platform="CUDA")
        module.set_process_index(jax.process_index())
        # Before the interpreter (and CUDA) shut down: finalize and destroy
        # the communicators, so peers see a clean exit.
        atexit.register(module.destroy_communicators)
        _registered = True


def _group_key(device_ids: Sequence[int], ring: int) -> tuple:
    return (tuple(int(d) for d in device_ids), int(ring))


def _published_key(device_ids: Sequence[int], ring: int) -> str:
    digest = hashlib.sha1(",".join(map(str, device_ids)).encode()).hexdigest()
    return _KEY.format(digest, ring)


def _id_for(devices: Sequence, ring: int, timeout_s: float) -> bytes:
    """The unique id of ring `ring` over `devices` (in rank order)."""
    ids = [d.id for d in devices]
    key = _group_key(ids, ring)
    # Held while the id is made or fetched, so that two threads lowering at
    # once do not publish one key twice.
    with _id_lock:
        if key in _ids:
            return _ids[key]
        module = require("jaxring.allreduce")
        owner = devices[0].process_index
        if len({d.process_index for d in devices}) == 1:
            made = module.new_unique_id()
        else:
            made = _exchange(module, ids, ring, owner, timeout_s)
        _ids[key] = made
        return made


def job_client():
    """jax.distributed's key-value client, for a ring whose GPUs belong to
    several processes (a RuntimeError if this process has none)."""

    client = jax_compat.distributed_client()
    if client is None:
        raise RuntimeError(
            "jaxring.allreduce: the ring's GPUs belong to several processes but "
            "jax.distributed is not initialized in this one; call "
            "jax.distributed.initialize() first."
        )
    return client


def _exchange(module, device_ids, ring, owner: int, timeout_s: float) -> bytes:

    client = job_client()
    name = _published_key(device_ids, ring)
    if jax_compat.distributed_state()[0] == owner:
        made = module.new_unique_id()
        client.key_value_set(name, base64.b64encode(made).decode())
        return made
    try:
        text = client.blocking_key_value_get(name, int(timeout_s * 1000))
    except Exception as e:  # the client raises its own error types
        raise RuntimeError(
            f"jaxring: process {owner} did not publish the NCCL id of ring "
            f"{ring} within {timeout_s} s (is it running the same program?): "
            f"{e}"
        ) from e
    return base64.b64decode(text)


def unique_ids(groups: Sequence[Sequence], rings: int, timeout_s: float) -> np.ndarray:
    """The nccl_ids attribute: one id per (group, ring), group-major."""
    words = []
    for devices in groups:
        for r in range(rings):
            raw = _id_for(devices, r, timeout_s)
            words.append(np.frombuffer(raw, dtype=np.int64))
    out = np.concatenate(words) if words else np.zeros(0, np.int64)
    assert out.size == len(groups) * rings * _ID_WORDS
    return out.astype(np.int64)


def rank_devices(groups: Sequence[Sequence]) -> np.ndarray:
    """The rank_device attribute: the device ordinal of each rank, group by
    group, beside rank_process (the process of each rank).

    A device of another process has no ordinal this process can read (its
    local_hardware_id is None); -1 stands for it. The handler only looks
    for its own (process, ordinal), which is always readable."""
    return np.asarray(
        [
            -1 if d.local_hardware_id is None else d.local_hardware_id
            for devices in groups
            for d in devices
        ],
        np.int64,
    )
