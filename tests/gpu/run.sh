#!/bin/sh
# The GPU suite: make test-gpu (and make test, which skips it, saying why,
# where there is no GPU).  Usage: tests/gpu/run.sh BUILD_DIR [--require]
# With --require a missing GPU fails instead of skipping.
build=$1
require=$2
here=$(dirname "$0")
if ! why=$("$build/tests/gpu/gpu_probe" 2>&1); then
  if [ "$require" = --require ]; then
    echo "FAIL GPU suite: $why"
    exit 1
  fi
  echo "SKIP GPU suite: $why"
  exit 0
fi
mkdir -p "$build/test-logs/gpu"
echo "GPU suite on $why${CUDA_VISIBLE_DEVICES:+ (CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES)}"
"$here/../run-tests.sh" "$build" gpu $(cd "$build/tests" && ls -1 gpu/test_gpu_* 2>/dev/null)
rc=$?
if "$here/programs.sh" "$build" >"$build/test-logs/gpu/programs.log" 2>&1; then
  echo "  PASS  gpu/programs.sh"
else
  echo "  FAIL  gpu/programs.sh"
  sed 's/^/        | /' "$build/test-logs/gpu/programs.log" | tail -n 40
  rc=1
fi
exit $rc
