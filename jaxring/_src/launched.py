"""What ``python -m jaxring.launch`` runs in each process it starts.

Initializes jax.distributed from the environment the launcher set, then runs
the user's script as ``__main__``, so a script written for one process runs
unchanged as one process of N. The script must not call
``jax.distributed.initialize`` itself.
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: python -m jaxring._src.launched script.py [args]")
    script, args = sys.argv[1], sys.argv[2:]
    import jax

    # JAX's own collectives across processes (lax.psum on CPU) need Gloo;
    # jaxring's own allreduces use jaxring's TCP transport either way.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=os.environ["JAXRING_COORDINATOR"],
        num_processes=int(os.environ["JAXRING_NUM_PROCESSES"]),
        process_id=int(os.environ["JAXRING_PROCESS_ID"]))
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
