"""Run by tests/test_multiprocess.py: a script written for a cluster, which
initializes jax.distributed itself with no arguments, runs unchanged under
the launcher; a call that asks for another job is refused, saying why."""

import os

import jax

jax.distributed.initialize()
# The same job, named in full, is accepted too.
jax.distributed.initialize(
    os.environ["JAX_COORDINATOR_ADDRESS"],
    int(os.environ["JAXRING_NUM_PROCESSES"]),
    process_id=int(os.environ["JAXRING_PROCESS_ID"]),
)

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402
from report import report  # noqa: E402

import jaxring  # noqa: E402

mesh = jax.make_mesh((jax.device_count(),), ("i",))
rows = np.arange(jax.device_count() * 3, dtype=np.float32).reshape(-1, 3)
x = jax.make_array_from_callback(rows.shape, NamedSharding(mesh, P("i")), lambda index: rows[index])
total = jax.jit(
    jax.shard_map(lambda v: jaxring.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
)
got = np.asarray(total(x).addressable_data(0))
report("process", index=jax.process_index(), count=jax.process_count())
report("sum", got=got.ravel().tolist(), want=rows.sum(0).tolist())
try:
    jax.distributed.initialize(num_processes=jax.process_count() + 1)
    report("no_error")
except RuntimeError as e:
    report("refused", message=" ".join(str(e).split()))
