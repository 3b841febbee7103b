#!/bin/sh
# The Python runs on the GPU machine, from a folder packed by carry.sh (the
# machine cannot build or install anything):
#   tests/python/gpu.sh OUT_DIR
# writes OUT_DIR/env.txt (GPU, driver, Python, torch, pytest), pytest.txt (the
# package's tests, tests/python, test_gpu.py included), e2e-cuda_ipc.txt and
# e2e-tcp.txt (the prefill/decode model test on cuda:0 over each transport,
# with e2e-equal-cuda0-*.json) and bench.txt (Python vs C reads from a pool
# on the GPU).  The system's libraries come before the packed ones, which
# only fill in what the machine lacks (hiredis, libuv, ...).
out=${1:?usage: $0 OUT_DIR}
cd "$(dirname "$0")/../.." || exit 1
export LD_LIBRARY_PATH=/usr/local/nvidia/lib64:/usr/lib/x86_64-linux-gnu:$PWD/lib
export PATH=$PWD/bin:$PATH SEGXFER_BUILD=$PWD/build PYTHONUNBUFFERED=1
export SEGXFER_LIB=$PWD/build/lib/libsegxfer.so
python3 -c 'import pytest' 2>/dev/null || export PYTHONPATH=$PWD/site
python3 -c 'import pydantic' 2>/dev/null ||
  export PYTHONPATH="$PWD/site-pydantic${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import typing_extensions' 2>/dev/null ||
  export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD/site-typing"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c 'import sys, torch; print("python", sys.version.split()[0], "torch",
torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))'
  python3 -c 'import pytest; print("pytest", pytest.__version__, pytest.__file__)'
} >"$out/env.txt" 2>&1
timeout 300 python3 -m pytest -q -rs -p no:cacheprovider -W ignore::DeprecationWarning \
  tests/python >"$out/pytest.txt" 2>&1
echo "rc=$?" >>"$out/pytest.txt"
for t in cuda_ipc tcp; do
  SEGXFER_E2E_DEVICE=cuda:0 SEGXFER_E2E_TRANSPORT=$t SEGXFER_E2E_RESULTS=$out timeout 300 \
    python3 tests/python/test_e2e_prefill_decode.py >"$out/e2e-$t.txt" 2>&1
  echo "rc=$?" >>"$out/e2e-$t.txt"
done
timeout 90 python3 tests/python/bench.py build --target-location cuda:0 --batches 50 \
  --rounds 5 >"$out/bench.txt" 2>&1
echo "rc=$?" >>"$out/bench.txt"
