"""Run by tests/test_multiprocess.py: the CPU link emulation cannot apply to
a ring that spans processes; tracing such an allreduce must say so."""

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from report import report

import jaxring

jaxring.config.update("cpu_link", "1Gbit,10us")
mesh = Mesh(np.array(jax.devices()), ("x",))
f = jax.jit(
    jax.shard_map(
        lambda v: jaxring.allreduce(v, "x"),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
        check_vma=False,
    )
)
try:
    f.lower(jax.ShapeDtypeStruct((mesh.size, 4), np.float32))
    report("no_error")
except NotImplementedError as e:
    report("refused", message=" ".join(str(e).split()))
