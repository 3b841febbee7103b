#!/bin/sh
# Run a list of test binaries from the registry in the Makefile.
# Usage: tests/run-tests.sh BUILD_DIR SUITE_NAME test_name...
# Each test's output goes to BUILD_DIR/test-logs/<name>.log and is shown when it
# fails.  Exits non-zero when any test fails.  SX_TEST_TIMEOUT (seconds, default
# 300) bounds each binary so a hang fails instead of wedging CI.  SX_TEST_WRAPPER
# (e.g. "valgrind --error-exitcode=1 ...") runs each binary under a tool.
# SX_TEST_JOBS=N (default 1) runs N tests at a time, in N lanes taking the
# tests in turn; the results are then printed in the order given.
build=$1 suite=$2
shift 2
[ $# -eq 0 ] && exit 0
logs="$build/test-logs"
mkdir -p "$logs"
jobs=${SX_TEST_JOBS:-1}
case $jobs in '' | *[!0-9]* | 0) jobs=1 ;; esac

# One test: its log, and a result line (PASS|FAIL secs rc) in its .result.
one() {
  t=$1
  start=$(date +%s.%N)
  # shellcheck disable=SC2086 # the wrapper is a command line
  if timeout -k 10 "${SX_TEST_TIMEOUT:-300}" $SX_TEST_WRAPPER "$build/tests/$t" \
      >"$logs/$t.log" 2>&1; then
    rc=0
  else
    rc=$?
  fi
  secs=$(awk -v a="$(date +%s.%N)" -v b="$start" 'BEGIN{printf "%.1f", a-b}')
  echo "$secs $rc" >"$logs/$t.result"
}

report() {
  t=$1
  secs=- rc=125 # no result: its lane died
  [ -r "$logs/$t.result" ] && read -r secs rc <"$logs/$t.result"
  rm -f "$logs/$t.result"
  if [ "$rc" -eq 0 ]; then
    pass=$((pass + 1))
    printf '  PASS  %-28s %6ss\n' "$t" "$secs"
  else
    failed="$failed $t"
    printf '  FAIL  %-28s %6ss (exit %d)\n' "$t" "$secs" "$rc"
    sed 's/^/        | /' "$logs/$t.log" | tail -n 60
  fi
}

failed=""
pass=0
if [ "$jobs" -eq 1 ]; then
  for t in "$@"; do
    one "$t"
    report "$t"
  done
else
  lane=0
  while [ "$lane" -lt "$jobs" ]; do
    (
      i=0
      for t in "$@"; do
        [ $((i % jobs)) -eq "$lane" ] && one "$t"
        i=$((i + 1))
      done
    ) &
    lane=$((lane + 1))
  done
  wait
  for t in "$@"; do
    report "$t"
  done
fi
if [ -n "$failed" ]; then
  echo "$suite: FAILED:$failed ($pass passed)"
  exit 1
fi
echo "$suite: all $pass passed"
