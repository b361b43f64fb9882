#!/usr/bin/env bash
# The GPU checks of the CUDA backend, for a machine with one GPU, no
# network, and jax with CUDA, NCCL's wheel, nanobind and scikit-build-core
# installed:
#
#   bash tests/gpu/run_device_checks.sh [LOG_DIR] [--budget S] [--only STEP ...]
#
# LOG_DIR defaults to $OUT when set, else /tmp/jaxring-gpu-checks. It
# receives summary.txt (written as the run goes), build.log and
# logs.tar.gz (every step's and every rank's log). device_checks.py says
# what the steps are and how time limits, hangs and failures are handled.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
logs="${OUT:-/tmp/jaxring-gpu-checks}"
if [ $# -gt 0 ] && [ "${1#--}" = "$1" ]; then
  logs="$1"
  shift
fi
exec "${PYTHON:-python3}" -u "$here/device_checks.py" "$logs" "$@"
