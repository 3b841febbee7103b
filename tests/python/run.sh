#!/bin/sh
# The Python package's tests (tests/python/), for `make check`: one PASS/FAIL
# line, the pytest output in BUILD/test-logs/python.log (shown on failure).
# They run with Debian's interpreter, /usr/bin/python3 ($PYTHON overrides), where
# python3-torch, python3-numpy and python3-pytest (make deps) install; the
# conftest starts its own redis-server on a free loopback port.
#
# Usage: tests/python/run.sh BUILD_DIR [pytest args...]
build=${1:-build}
shift
py=${PYTHON:-/usr/bin/python3}
logs="$build/test-logs"
mkdir -p "$logs"
if ! $py -c 'import pytest, torch, numpy' 2>/dev/null; then
  echo "  FAIL  python package: $py lacks pytest, torch or numpy (make deps installs them)"
  exit 1
fi
# A sanitizer build's library needs its runtimes loaded first: the
# interpreter is not built with them.  Python's own allocations at exit are
# not ours to report, so leak detection is off (valgrind covers the C tests).
lib="$build/lib/libsegxfer.so"
preload=
for rt in asan ubsan; do
  if ldd "$lib" 2>/dev/null | grep -q "lib$rt\.so"; then
    preload="$preload $(gcc -print-file-name=lib$rt.so)"
  fi
done
# pytest captures the tests' file descriptors, and a sanitizer report
# written there is lost when the process dies: reports go to files instead,
# shown (and failing the run) below.
rm -f "$logs"/python-san.*
san="log_path=$(cd "$logs" && pwd)/python-san"
start=$(date +%s)
if SEGXFER_BUILD="$build" SEGXFER_LIB="$lib" LD_PRELOAD="${preload# }" \
    ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=0}:$san" UBSAN_OPTIONS="${UBSAN_OPTIONS:-}:$san" \
    $py -m pytest -q -rs -p no:cacheprovider tests/python "$@" >"$logs/python.log" 2>&1 &&
    ! ls "$logs"/python-san.* >/dev/null 2>&1; then
  printf '  PASS  %-28s %5ss  (%s)\n' "python package (pytest)" $(($(date +%s) - start)) \
    "$(tail -n 1 "$logs/python.log" | tr -d '=' | sed 's/^ *//;s/ *$//')"
else
  sed 's/^/        | /' "$logs/python.log" | tail -n 80
  for f in "$logs"/python-san.*; do
    [ -f "$f" ] && { echo "        | $f:"; sed 's/^/        | /' "$f" | head -n 60; }
  done
  echo "  FAIL  python package (pytest; log: $logs/python.log)"
  exit 1
fi
