"""Under the launcher, after `-m jaxring.tune` wrote a table: lowers
jaxring.allreduce with nothing set, at each tuned size, and prints the
table's candidate next to what the custom call carries, one "choice"
report per size, then checks the values against numpy and reports "done".

    python tuned_lowering.py TABLE.json
"""

import re
import sys

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from report import report

import jaxring
from jaxring import _jaxring
from jaxring._src import tuning


def main():
    path = sys.argv[1]
    jaxring.config.update("tuning", path)
    devices = jax.devices()
    n = len(devices)
    mesh = Mesh(np.array(devices), ("i",))
    table = tuning.load(path)[tuning.key("cpu", n, jax.process_count())]
    f = jax.jit(
        jax.shard_map(
            lambda v: jaxring.allreduce(v, "i"),
            mesh=mesh,
            in_specs=P("i"),
            out_specs=P("i"),
            check_vma=False,
        )
    )
    for size in sorted(int(s) for s in table["choices"]):
        count = size // 4
        x = jax.make_array_from_callback(
            (n, count),
            NamedSharding(mesh, P("i")),
            lambda idx: np.full((1, count), idx[0].start + 1, np.float32),
        )
        hlo = f.lower(x).as_text()
        attrs = {
            k: int(re.search(rf"{k} = (\d+)", hlo).group(1))
            for k in ("num_rings", "chunk_bytes", "algorithm")
        }
        algorithm = {v: k for k, v in _jaxring.ALGORITHMS.items()}[attrs["algorithm"]]
        tiered = re.search(r"topology = dense<([^>]*)>", hlo).group(1) != ""
        c = tuning.lookup(table, size)
        report(
            "choice",
            size=size,
            table=[c.algorithm, c.rings, c.chunk_bytes, c.topology],
            lowered=[
                algorithm,
                attrs["num_rings"],
                attrs["chunk_bytes"],
                "auto" if tiered else "flat",
            ],
        )
        out = f(x)
        for shard in out.addressable_shards:
            np.testing.assert_array_equal(
                np.asarray(shard.data), np.full((1, count), n * (n + 1) / 2)
            )
    report("done")


if __name__ == "__main__":
    main()
