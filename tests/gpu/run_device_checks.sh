#!/usr/bin/env bash
# The GPU checks of the CUDA backend, for a machine with one GPU, no
# network, and jax with CUDA, NCCL's wheel, nanobind and scikit-build-core
# installed: builds jaxring with JAXRING_CUDA=ON, runs tests/gpu, then the
# GPU benchmarks. Aims to finish in under 8 minutes.
#
#   bash tests/gpu/run_device_checks.sh [LOG_DIR]
#
# Writes build.log, tests.log and bench.log into LOG_DIR (default $OUT when
# set, else /tmp/jaxring-gpu-checks) and exits non-zero if the build, a test
# or a benchmark failed. It builds against the installed jax (no network, so
# no build isolation) and stops at once if that jax is outside the range
# jaxring is tested on.
set -uo pipefail
repo="$(cd "$(dirname "$0")/../.." && pwd)"
logs="${1:-${OUT:-/tmp/jaxring-gpu-checks}}"
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
# Each rank of a multi-process check writes its own log here.
export JAXRING_GPU_LOGS="$logs/ranks"
py="${PYTHON:-python3}"
start=$SECONDS

echo "== machine"
nvidia-smi -L 2>&1 | head -4
"$py" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tail -1

echo "== jax version"
if ! "$py" - "$repo/jaxring/_src/jax_compat.py" <<'EOF'; then
import runpy, sys
compat = runpy.run_path(sys.argv[1])
if not compat["in_tested_range"]():
    sys.exit(f"jaxring is tested with {compat['SUPPORTED_JAX_TEXT']}; this machine "
             f"has {', '.join(compat['untested_versions']())}: stopping before the build")
print("jax in the tested range:", compat["SUPPORTED_JAX_TEXT"])
EOF
  echo "UNSUPPORTED JAX"
  exit 1
fi

# Without OpenSSL's headers the TCP transport is left out (the GPU checks do
# not use it); said here so that the build log is not the first to tell.
tcp_auth=ON
if [ ! -f /usr/include/openssl/hmac.h ]; then
  echo "no OpenSSL headers: building with JAXRING_TCP_AUTH=OFF"
  tcp_auth=OFF
fi
echo "== build (JAXRING_CUDA=ON JAXRING_TCP_AUTH=$tcp_auth)"
if ! (cd "$repo" && JAXRING_CUDA=ON JAXRING_TCP_AUTH=$tcp_auth timeout 300 "$py" -m pip install \
        --no-build-isolation --no-deps -v . > "$logs/build.log" 2>&1); then
  tail -40 "$logs/build.log"
  echo "BUILD FAILED"
  exit 1
fi
grep -E "jaxring CUDA backend|Successfully installed" "$logs/build.log"
(cd /tmp && "$py" -c "import jaxring; print(jaxring.build_info())") || exit 1
(cd "$repo/tests/gpu" && "$py" -c "import gpu_worker as w; v = w.installed_nccl_version(); \
print('NCCL', v, '- ranks share the GPU with', w.sharing_mode(v))")
echo "build took $((SECONDS - start)) s"

echo "== GPU tests"
# From outside the checkout, so that the installed package is imported.
cd /tmp
# The CPU-side lowering tests first: cheap, and they tell a lowering bug
# from a GPU one.
timeout -s ABRT 330 "$py" -m pytest -q -rA -p no:cacheprovider \
    "$repo/tests/test_cuda_backend.py" "$repo/tests/gpu" 2>&1 | tee "$logs/tests.log" | tail -40
tests_rc=${PIPESTATUS[0]}
echo "tests took $((SECONDS - start)) s in all"

echo "== GPU benchmarks"
timeout 150 "$py" "$repo/benchmarks/gpu_allreduce.py" 2>&1 | tee "$logs/bench.log"
bench_rc=${PIPESTATUS[0]}
echo "all took $((SECONDS - start)) s; tests rc=$tests_rc, benchmarks rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
