"""What the GPU machine has, before anything is built (`probe.py`), and
what the build gave (`probe.py --built`); the first step of
device_checks.py. Prints everything it finds and fails only on what makes
the later steps pointless: a jax outside the tested range, or, with
--built, a jaxring without its CUDA backend or a GPU it cannot see."""

import ctypes
import glob
import os
import runpy
import shutil
import subprocess
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def command(*argv) -> str:
    if shutil.which(argv[0]) is None:
        return f"{argv[0]}: not found"
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return f"{argv[0]}: no answer in 30 s"
    return (r.stdout + r.stderr).strip()


def wheel_nccl_version() -> str:
    """ncclGetVersion of the libnccl.so.2 in NCCL's wheel, if any."""
    try:
        import nvidia.nccl as n
    except ImportError:
        return "no nvidia-nccl wheel"
    libs = [p for d in n.__path__ for p in glob.glob(os.path.join(d, "lib", "libnccl.so*"))]
    if not libs:
        return "nvidia-nccl wheel without libnccl.so"
    lib = ctypes.CDLL(libs[0])
    code = ctypes.c_int()
    if lib.ncclGetVersion(ctypes.byref(code)) != 0:
        return f"{libs[0]}: ncclGetVersion failed"
    v = code.value
    return f"{v // 10000}.{v // 100 % 100}.{v % 100} ({libs[0]})"


def before_build() -> int:
    print("== GPU")
    print(
        command(
            "nvidia-smi",
            "--query-gpu=name,compute_mode,memory.total,driver_version,clocks.max.sm",
            "--format=csv",
        )
    )
    print("== tools")
    print("python", sys.version.split()[0], sys.executable)
    inc = sysconfig.get_paths()["include"]
    print(
        "Python.h:",
        "found" if os.path.exists(os.path.join(inc, "Python.h")) else f"MISSING in {inc}",
    )
    print(
        "OpenSSL headers:",
        "found"
        if os.path.exists("/usr/include/openssl/hmac.h")
        else "missing (the TCP transport is built without authentication)",
    )
    for tool in (("nvcc", "--version"), ("cmake", "--version"), ("ninja", "--version")):
        print(command(*tool).splitlines()[-1])
    if shutil.which("nvcc") is None and os.path.exists("/usr/local/cuda/bin/nvcc"):
        print("nvcc at /usr/local/cuda/bin (the build adds it to PATH)")
    print("c++:", command("c++", "--version").splitlines()[0])
    for name in ("CC", "CXX", "CFLAGS", "CXXFLAGS", "LDFLAGS", "LD_LIBRARY_PATH"):
        if os.environ.get(name):
            print(f"{name}={os.environ[name]}")
    print("== packages")
    from importlib import metadata

    for name in (
        "jax",
        "jaxlib",
        "jax-cuda13-plugin",
        "jax-cuda13-pjrt",
        "nvidia-nccl-cu13",
        "nanobind",
        "scikit-build-core",
        "numpy",
    ):
        try:
            print(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            print(f"{name}: not installed")
    print("NCCL (wheel):", wheel_nccl_version())
    compat = runpy.run_path(os.path.join(REPO, "jaxring", "_src", "jax_compat.py"))
    if not compat["in_tested_range"]():
        print(
            f"UNSUPPORTED JAX: jaxring is tested with {compat['SUPPORTED_JAX_TEXT']}; "
            f"this machine has {', '.join(compat['untested_versions']())}"
        )
        return 1
    print("jax in the tested range:", compat["SUPPORTED_JAX_TEXT"])
    import jax

    print("jax devices:", jax.devices())
    return 0


def after_build() -> int:
    import jaxring

    info = jaxring.build_info()
    print("build_info:", info)
    from jaxring._src import cuda_backend

    if cuda_backend.status() != "built":
        print("the CUDA backend is not built:", cuda_backend.status())
        return 1
    from jaxring import _jaxring_cuda

    import gpu_job

    nccl = gpu_job.installed_nccl_version()
    print(
        "NCCL loaded by jaxring:",
        ".".join(map(str, nccl)),
        "; CUDA runtime",
        _jaxring_cuda.cuda_runtime_version(),
        "; GPUs",
        _jaxring_cuda.device_count(),
    )
    print("ranks share the GPU with", gpu_job.sharing_mode(nccl))
    # Whether libstdc++ is linked into the modules or loaded beside them,
    # and whether they export any of it (they should not).
    for module in glob.glob(os.path.join(os.path.dirname(jaxring.__file__), "_jaxring*.so")):
        exported = command("nm", "-D", "--defined-only", module).splitlines()
        std = [l for l in exported if " _ZNSt" in l or " _ZSt" in l or " _ZNKSt" in l]
        linked = [l.strip() for l in command("ldd", module).splitlines() if "stdc++" in l]
        print(
            f"{os.path.basename(module)}: {len(std)} std:: symbols exported; "
            f"libstdc++: {linked or 'not loaded beside it (linked in)'}"
        )
    return 0 if _jaxring_cuda.device_count() > 0 else 1


if __name__ == "__main__":
    sys.exit(after_build() if "--built" in sys.argv[1:] else before_build())
