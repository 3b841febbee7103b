#!/bin/sh
# Pack what the GPU suite and the GPU benchmarks need into one folder, to
# run them on a GPU machine that cannot build or install packages:
#   tests/gpu/carry.sh BUILD_DIR DEST
# DEST gets build/ (programs and the GPU test binaries), tests/ (the
# scripts, with the many-core bench scripts of tests/bench), lib/ (the shared libraries they load, as ldd lists them, less
# the C library itself) and bin/ (redis-server for the two-process tests).
# There: cd DEST && LD_LIBRARY_PATH=$PWD/lib tests/gpu/run.sh build --require
set -e
build=$1
dest=$2
[ -n "$build" ] && [ -n "$dest" ] || { echo "usage: $0 BUILD_DIR DEST" >&2; exit 2; }
rm -rf "$dest"
mkdir -p "$dest/build/tests/gpu" "$dest/build/bin" "$dest/tests/gpu" "$dest/lib" "$dest/bin"
cp "$build"/tests/gpu/test_gpu_* "$build/tests/gpu/gpu_probe" "$build/tests/gpu/drv_cost" "$build/tests/gpu/cpu_lines" "$dest/build/tests/gpu/"
cp "$build"/bin/* "$dest/build/bin/"
cp tests/run-tests.sh "$dest/tests/"
mkdir -p "$dest/tests/support"
cp tests/support/servers.sh "$dest/tests/support/"
cp tests/gpu/*.sh "$dest/tests/gpu/"
mkdir -p "$dest/tests/bench"
cp tests/bench/fleet_cluster.sh tests/bench/tcp_threads.sh "$dest/tests/bench/"
for b in redis-server redis-cli; do
  p=$(command -v $b) && cp "$p" "$dest/bin/"
done
for f in "$dest"/build/tests/gpu/* "$dest"/build/bin/* "$dest"/bin/*; do
  ldd "$f" | awk '/=> \// { print $3 }'
done | sort -u | while read -r lib; do
  case $(basename "$lib") in
    libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|ld-linux*|libstdc++*|libgcc_s*) ;;
    *) cp -L "$lib" "$dest/lib/" ;;
  esac
done
du -sh "$dest"
