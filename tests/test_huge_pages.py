"""Huge-page advice on result buffers (xla_ffi/cpu/huge_pages.h): given by
default, not where glibc keeps freed buffers (MALLOC_MMAP_THRESHOLD_ set, as
jaxring.launch --keep-freed-memory does), JAXRING_HUGE_PAGES deciding over
both. Checked on the result's own mapping: the kernel lists advised ranges
with the VmFlags "hg" in /proc/self/smaps. The advice is read once per
process, so each case runs in a process of its own.

NumPy advises its own large arrays too (NUMPY_MADVISE_HUGEPAGE). Where glibc
keeps freed buffers, a freed NumPy array's advised range stays in the heap and
XLA may place the result there, so the probe turns NumPy's advice off: what is
checked is jaxring's advice alone."""

import os
import subprocess
import sys

import pytest
from reports import REPORT_SOURCE, reports

pytestmark = [
    pytest.mark.skipif(
        not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
        reason="this kernel has no transparent huge pages",
    ),
    pytest.mark.jax_independent,  # the C++ buffers' own code
]

PROBE = (
    REPORT_SOURCE
    + r"""
import jaxring
jaxring.use_cpu_devices(2)
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("i",))
f = jax.jit(jax.shard_map(lambda v: jaxring.allreduce(v, "i"), mesh=mesh,
                          in_specs=P("i"), out_specs=P("i"), check_vma=False))
count = (8 << 20) // 4
x = jax.device_put(np.ones((2, count), np.float32), NamedSharding(mesh, P("i")))
out = f(x)
out.block_until_ready()
assert float(np.asarray(out)[1, -1]) == 2.0
# The middle of the 8 MiB result: inside the 2 MiB-aligned range advised.
ptr = out.addressable_shards[0].data.unsafe_buffer_pointer() + (4 << 20)
start = end = 0
flags = None
for line in open("/proc/self/smaps"):
    head = line.split()
    if line.startswith("VmFlags:"):
        if start <= ptr < end:
            flags = head[1:]
    elif "-" in head[0] and ":" not in head[0]:
        start, end = (int(v, 16) for v in head[0].split("-"))
report("advised", advised="hg" in flags)
"""
)


def advised(env: dict) -> bool:
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("JAXRING_HUGE_PAGES", "MALLOC_MMAP_THRESHOLD_", "XLA_FLAGS")
    }
    r = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        env={**base, "NUMPY_MADVISE_HUGEPAGE": "0", **env},
        cwd="/",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    # The probe's last line: its one report, whether the range was advised.
    last = reports(r.stdout.strip().splitlines()[-1:])
    assert len(last) == 1 and last[0]["kind"] == "advised", r.stdout[-3000:]
    assert isinstance(last[0]["advised"], bool), last
    return last[0]["advised"]


def test_results_are_advised_unless_glibc_keeps_freed_buffers():
    assert advised({})
    assert not advised({"MALLOC_MMAP_THRESHOLD_": "1073741824"})


def test_jaxring_huge_pages_decides_over_both():
    assert advised({"JAXRING_HUGE_PAGES": "1", "MALLOC_MMAP_THRESHOLD_": "1073741824"})
    assert not advised({"JAXRING_HUGE_PAGES": "0"})
