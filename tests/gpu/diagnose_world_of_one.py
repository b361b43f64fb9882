"""Run by device_checks.py only when the world-of-one test failed: the same
program again in ways that tell causes apart, each under its own time
limit, all printed.

1. Under cuda-gdb (when the machine has it), which prints the native stack
   of a crash: where in jaxring, NCCL or XLA it happened.
2. Without the NCCL settings the test harness adds (NCCL_MAX_CTAS,
   NCCL_LAUNCH_ORDER_IMPLICIT): whether one of them is the cause.
3. With NCCL_DEBUG=INFO: NCCL's account of the communicators' set-up.

Exits 0: it diagnoses, the test itself passes or fails.
"""

import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import gpu_worker  # noqa: E402

SCRIPT = os.path.join(HERE, "world_of_one.py")


def attempt(title: str, argv: list, env: dict, limit_s: float) -> None:
    print(f"\n==== {title}\n$ {' '.join(argv)}", flush=True)
    try:
        r = subprocess.run(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            timeout=limit_s,
        )
        print(r.stdout[-20000:])
        print(f"---- exit status {r.returncode}", flush=True)
    except subprocess.TimeoutExpired as e:
        out = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode(errors="replace")
        print(out[-12000:])
        print(f"---- still running after {limit_s} s", flush=True)


def main() -> int:
    env = gpu_worker.gpu_env(1)
    gdb = shutil.which("cuda-gdb") or (
        "/usr/local/cuda/bin/cuda-gdb" if os.path.exists("/usr/local/cuda/bin/cuda-gdb") else None
    )
    if gdb:
        attempt(
            "under cuda-gdb: the native stack of a crash",
            [
                gdb,
                "-q",
                "-batch",
                "-ex",
                "set pagination off",
                "-ex",
                "set confirm off",
                "-ex",
                "run",
                "-ex",
                "bt 30",
                "-ex",
                "info sharedlibrary",
                "--args",
                sys.executable,
                SCRIPT,
                "ring",
            ],
            env,
            120,
        )
    else:
        print("no cuda-gdb on this machine", flush=True)
    plain = {
        k: v for k, v in env.items() if k not in ("NCCL_MAX_CTAS", "NCCL_LAUNCH_ORDER_IMPLICIT")
    }
    attempt(
        "without NCCL_MAX_CTAS and NCCL_LAUNCH_ORDER_IMPLICIT",
        [sys.executable, SCRIPT, "ring"],
        plain,
        40,
    )
    attempt("algorithm nccl alone", [sys.executable, SCRIPT, "nccl"], env, 40)
    attempt(
        "NCCL_DEBUG=INFO",
        [sys.executable, SCRIPT, "ring"],
        dict(env, NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT,ENV"),
        40,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
