#!/bin/sh
# Pack what the Python package's tests, the end-to-end model test and the
# Python benchmark need into one folder laid out like this tree, to run them
# on a GPU machine that cannot build or install packages:
#   tests/python/carry.sh BUILD_DIR DEST
# DEST gets build/ (the library, sx-agent, sxctl, the tests' C helpers),
# python/ (the package), tests/python/, docs/python.md, errors.h, lib/ (the shared libraries they load,
# as ldd lists them, less the C library itself), bin/ (redis-server) and
# site/ (Debian's pytest and what it imports, pure Python, for an interpreter
# without pytest) and site-pydantic/ (the same for pydantic).  There:
#   cd DEST && export LD_LIBRARY_PATH=$PWD/lib PATH=$PWD/bin:$PATH \
#     SEGXFER_BUILD=$PWD/build SEGXFER_LIB=$PWD/build/lib/libsegxfer.so
#   python3 -c 'import pytest' || export PYTHONPATH=$PWD/site
#   python3 -m pytest -q -rs tests/python
set -e
build=$1
dest=$2
[ -n "$build" ] && [ -n "$dest" ] || { echo "usage: $0 BUILD_DIR DEST" >&2; exit 2; }
rm -rf "$dest"
mkdir -p "$dest/build/lib" "$dest/build/bin" "$dest/build/tests/python" "$dest/python" \
  "$dest/tests/python" "$dest/lib" "$dest/bin" "$dest/site" "$dest/docs" \
  "$dest/include/segxfer"
cp -P "$build"/lib/libsegxfer.so* "$dest/build/lib/"
cp "$build/bin/sx-agent" "$build/bin/sxctl" "$dest/build/bin/"
cp "$build/tests/python/abi_probe" "$build/tests/python/bench_read" "$dest/build/tests/python/"
cp -r python/segxfer "$dest/python/"
cp python/_segxfer_hook.py python/segxfer.pth "$dest/python/"   # the LMDeploy hook's tests
cp python/_segxfer_sglang_hook.py python/segxfer-sglang.pth "$dest/python/"
cp tests/python/*.py tests/python/*.sh "$dest/tests/python/"
cp -r tests/python/standin "$dest/tests/python/"   # LMDeploy and mmengine stand-ins
cp -r tests/python/sglang_standin "$dest/tests/python/"   # test_sglang_hook's SGLang
cp docs/python.md "$dest/docs/"   # test_docs runs the lines it shows
cp include/segxfer/errors.h "$dest/include/segxfer/"   # test_errors reads the table
p=$(command -v redis-server) && cp "$p" "$dest/bin/"
for f in "$dest"/build/lib/libsegxfer.so "$dest"/build/bin/* "$dest"/build/tests/python/* \
    "$dest"/bin/*; do
  ldd "$f" | awk '/=> \// { print $3 }'
done | sort -u | while read -r lib; do
  case $(basename "$lib") in
    libc.so.*|libm.so.*|libdl.so.*|libpthread.so.*|librt.so.*|ld-linux*|libstdc++*|libgcc_s*) ;;
    *) cp -L "$lib" "$dest/lib/" ;;
  esac
done
dist=/usr/lib/python3/dist-packages
for m in pytest _pytest pluggy iniconfig packaging attr attrs py py.py; do
  [ -e "$dist/$m" ] && cp -r "$dist/$m" "$dest/site/"
done
# Debian's pydantic (pure Python) for the LMDeploy messages, on the path only
# where the machine's interpreter has none (gpu.sh); its typing_extensions
# apart, on the path only where the interpreter has none either (Debian's
# 4.4 breaks Python 3.12's anyio, which pytest loads there).
mkdir -p "$dest/site-pydantic" "$dest/site-typing"
[ -e "$dist/pydantic" ] && cp -r "$dist/pydantic" "$dest/site-pydantic/"
[ -e "$dist/typing_extensions.py" ] && cp "$dist/typing_extensions.py" "$dest/site-typing/"
find "$dest" -name __pycache__ -prune -exec rm -rf {} +
du -sh "$dest"
