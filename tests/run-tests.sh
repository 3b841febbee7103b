#!/bin/sh
# Run a list of test binaries from the registry in the Makefile.
# Usage: tests/run-tests.sh BUILD_DIR SUITE_NAME test_name...
# Each test's output goes to BUILD_DIR/test-logs/<name>.log and is shown when it
# fails.  Exits non-zero when any test fails.  SX_TEST_TIMEOUT (seconds, default
# 300) bounds each binary so a hang fails instead of wedging CI.  SX_TEST_WRAPPER
# (e.g. "valgrind --error-exitcode=1 ...") runs each binary under a tool.
build=$1 suite=$2
shift 2
[ $# -eq 0 ] && exit 0
logs="$build/test-logs"
mkdir -p "$logs"
failed=""
pass=0
for t in "$@"; do
  start=$(date +%s.%N)
  # shellcheck disable=SC2086 # the wrapper is a command line
  if timeout -k 10 "${SX_TEST_TIMEOUT:-300}" $SX_TEST_WRAPPER "$build/tests/$t" \
      >"$logs/$t.log" 2>&1; then
    rc=0
  else
    rc=$?
  fi
  secs=$(awk -v a="$(date +%s.%N)" -v b="$start" 'BEGIN{printf "%.1f", a-b}')
  if [ $rc -eq 0 ]; then
    pass=$((pass + 1))
    printf '  PASS  %-28s %6ss\n' "$t" "$secs"
  else
    failed="$failed $t"
    printf '  FAIL  %-28s %6ss (exit %d)\n' "$t" "$secs" "$rc"
    sed 's/^/        | /' "$logs/$t.log" | tail -n 60
  fi
done
if [ -n "$failed" ]; then
  echo "$suite: FAILED:$failed ($pass passed)"
  exit 1
fi
echo "$suite: all $pass passed"
