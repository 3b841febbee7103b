#!/bin/sh
# The GPU suite: make test-gpu, and make test.  Usage:
#   tests/gpu/run.sh BUILD_DIR [--require]
# On a host with a GPU it runs on the GPU.  Without one, make test says
# plainly that the real-GPU suite was skipped and why, then runs the same
# suite on the host-memory stand-in for libcuda.so.1 (tests/gpu/fake_cuda.c),
# which checks segxfer's own logic (staging, the IPC handshake, unregister,
# failures) under the sanitizers, and nothing about CUDA itself.  With
# --require (make test-gpu) a missing GPU fails instead.
build=$1
require=$2
here=$(dirname "$0")

suite() { # $1: what it runs on
  mkdir -p "$build/test-logs/gpu"
  echo "GPU suite on $1${CUDA_VISIBLE_DEVICES:+ (CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES)}"
  # shellcheck disable=SC2046  # one argument per test binary
  "$here/../run-tests.sh" "$build" gpu $(cd "$build/tests" && ls -1 gpu/test_gpu_* 2>/dev/null)
  rc=$?
  # cuda_ipc again with every read's driver calls on the launcher's thread
  # (by default only reads that start while others are in flight go there)
  # and every block read planned into a gather table, however small (by
  # default from 256 ranges).
  SX_GPU_LAUNCHER=1 SX_IPC_TABLES=1 "$here/../run-tests.sh" "$build" \
    "gpu, SX_GPU_LAUNCHER=1 SX_IPC_TABLES=1" gpu/test_gpu_ipc gpu/test_gpu_push || rc=1
  # Every table read through the agent's loop, none direct on the
  # submitting thread (by default a segment's table reads go direct once
  # the loop ran one: the loop's own table path is this pass's).
  SX_IPC_DIRECT=0 SX_IPC_TABLES=1 "$here/../run-tests.sh" "$build" \
    "gpu, SX_IPC_DIRECT=0 SX_IPC_TABLES=1" gpu/test_gpu_ipc || rc=1
  # And with every block read planned as ranges, as without tables: not in
  # a sanitizer build (CI time; the plain build runs it, as a GPU does).
  if [ "${SX_GPU_SANITIZED:-0}" != 1 ]; then
    SX_IPC_TABLES=0 "$here/../run-tests.sh" "$build" "gpu, SX_IPC_TABLES=0" gpu/test_gpu_ipc || rc=1
  fi
  if "$here/programs.sh" "$build" >"$build/test-logs/gpu/programs.log" 2>&1; then
    echo "  PASS  gpu/programs.sh"
  else
    echo "  FAIL  gpu/programs.sh"
    sed 's/^/        | /' "$build/test-logs/gpu/programs.log" | tail -n 40
    rc=1
  fi
  return $rc
}

if why=$("$build/tests/gpu/gpu_probe" 2>&1); then
  suite "$why"
  exit $?
fi
if [ "$require" = --require ]; then
  echo "FAIL GPU suite: $why"
  exit 1
fi
echo "SKIP GPU suite on a real GPU: $why"
fake=$(cd "$build/tests/gpu" && pwd)/libfakecuda.so
if [ ! -f "$fake" ]; then
  echo "SKIP GPU suite on the stand-in driver: $fake is not built"
  exit 0
fi
SX_CUDA_LIBRARY=$fake
export SX_CUDA_LIBRARY
suite "the host-memory stand-in driver (tests/gpu/fake_cuda.c: segxfer's logic, not CUDA)"
