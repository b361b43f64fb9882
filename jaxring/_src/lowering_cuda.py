"""The CUDA backend's allreduce call: no rank operands, as the handler finds
its device in the rank tables (rank_process, rank_device); the NCCL ids of
its rings' communicators as attributes; the Choice is choice.for_cuda's;
and, before any of it runs, the processes of the ring agree on the call
(cuda_agreement.py), which NCCL itself would not check.
"""

from __future__ import annotations

import numpy as np

from jaxring._src import choice, cuda_agreement, cuda_backend, distributed
from jaxring._src.call_attributes import attributes, operands_text
from jaxring._src.mesh_tables import mesh_layout


def _ring_members(
    devices, rank_table: np.ndarray, group_table: np.ndarray, world: int
) -> list[list]:
    """The lowering's devices as rings of ranks: members[group][rank]."""
    n_groups = int(group_table.max()) + 1 if len(group_table) else 1
    members = [[None] * world for _ in range(n_groups)]
    for pid, dev in enumerate(devices):
        members[int(group_table[pid])][int(rank_table[pid])] = dev
    return members


def cuda_call(
    ctx,
    label,
    dtype,
    *,
    axes,
    groups,
    op,
    rings,
    chunk_bytes,
    timeout_s,
    link,
    algorithm,
    topology,
    rings_from_default,
) -> tuple[dict, list]:
    """The CUDA backend's attributes (CudaAttrs in xla_ffi/ring_attrs.h),
    and no rank operands; registers the CUDA targets first (or raises why
    there are none)."""
    del rings_from_default
    cuda_backend.register()
    if link:
        raise ValueError(
            "jaxring: cpu_link emulates links of the CPU backend; unset "
            "jaxring.config.cpu_link / JAXRING_CPU_LINK on GPUs."
        )
    if groups is not None and len({len(g) for g in groups}) > 1:
        raise NotImplementedError(
            "jaxring: axis_index_groups of different sizes are not supported "
            "on the CUDA backend yet (its communicators are made for one ring "
            "size); use groups of one size, or the CPU backend."
        )
    world, rank_table, group_table, devices = mesh_layout(ctx, axes, groups)
    if devices is None:
        raise NotImplementedError(
            "jaxring.allreduce: cannot tell which GPU runs each rank of this "
            "lowering (no device assignment)."
        )
    rank_process = distributed.process_table(devices, rank_table, group_table, world)
    chosen = choice.for_cuda(
        algorithm=algorithm,
        topology=topology,
        dtype=dtype,
        rank_process=rank_process,
        hosts=distributed.process_hosts(),
        world=world,
        rings=rings,
        chunk_bytes=chunk_bytes,
    )
    members = _ring_members(devices, rank_table, group_table, world)
    attrs = attributes(
        ctx,
        label,
        (members, chosen.tiers),
        chosen,
        world=world,
        rank_process=rank_process,
        uneven_sizes=(),
        op=op,
        timeout_s=timeout_s,
        link=(),
    )
    # What every process of the ring must lower at this place alike (NCCL
    # would not notice a difference: cuda_agreement.py).
    cuda_agreement.check_same_call(
        int(attrs["slot_id"]),
        f"{label} of {operands_text(ctx)} over {world} ranks, {chosen.rings} ring(s) "
        f"of {chosen.chunk_bytes}-byte chunks, algorithm {chosen.algorithm}, "
        f"tiers {list(chosen.tiers) or 'none'}",
        owner=int(rank_process[0]),
        processes=set(map(int, rank_process)),
        timeout_s=timeout_s,
    )
    attrs.update(
        rank_device=cuda_backend.rank_devices(members),
        nccl_ids=cuda_backend.unique_ids(members, chosen.rings, timeout_s),
    )
    return attrs, []
