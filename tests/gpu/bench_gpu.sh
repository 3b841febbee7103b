#!/bin/sh
# The GPU benchmarks of issue 21 in one go, on a machine with one or two
# GPUs (from a folder packed by tests/gpu/carry.sh):
#   tests/gpu/bench_gpu.sh BUILD_DIR [DURATION]
# The engine shape (4 layers x K,V, requests of 16 and 128 blocks of 16K
# and 32K, 8 requests in flight; 16 blocks of 1M) over cuda_ipc across two
# GPUs and on one GPU, each copy method forced once at 32K, and staged TCP.
build=$1
d=${2:-1}
bench=$build/bin/sx-bench
run() { echo "## SX_GPU_COPY=${SX_GPU_COPY:-} sx-bench read $*"; "$bench" read "$@" --duration "$d" 2>&1; echo "rc=$?"; }
pairs="cuda:0,cuda:0"
if [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -ge 2 ]; then
  pairs="cuda:0,cuda:1 cuda:0,cuda:0"
fi
for p in $pairs; do
  r=${p%,*}
  t=${p#*,}
  run --location "$r" --target-location "$t" --transport cuda_ipc --sizes 16K,32K \
    --layers 4 --kv 2 --request-blocks 16,128 --depth 8
  run --location "$r" --target-location "$t" --transport cuda_ipc --sizes 1M \
    --layers 4 --kv 2 --request-blocks 16 --depth 4 --group-bytes 256M
  for m in batch range; do
    SX_GPU_COPY=$m run --location "$r" --target-location "$t" --transport cuda_ipc \
      --sizes 32K --layers 4 --kv 2 --request-blocks 16,128 --depth 8 --rounds 2
  done
done
t=${pairs%% *}
run --location cuda:0 --target-location "${t#*,}" --transport tcp --sizes 32K,1M --layers 4 \
  --kv 2 --request-blocks 16 --depth 4 --group-bytes 256M
