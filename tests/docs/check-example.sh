#!/bin/sh
# make check: the engine-integration guide's program works, and the guide
# shows its code as it is.
#   - BUILD/tests/docs/engine_example (tests/docs/engine_example.c) runs on the
#     in-process store and must exit 0 having checked every byte it read;
#   - every line of every ```c block in docs/engine-guide.md must be a line of
#     tests/docs/engine_example.c (leading and trailing blanks aside; a line
#     that is just "..." marks an elision), so the guide cannot drift from the
#     code that runs.
# Usage: tests/docs/check-example.sh BUILD_DIR
set -u
build=$1
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
src=$here/engine_example.c
guide=$root/docs/engine-guide.md
log=$build/test-logs/engine-example.log
mkdir -p "$build/test-logs"
start=$(date +%s)
fail=0

if ! "$build/tests/docs/engine_example" >"$log" 2>&1; then
  echo "engine_example failed; its output:"
  sed 's/^/  | /' "$log" | tail -n 30
  fail=1
elif ! grep -q '^every byte checked$' "$log"; then
  echo "engine_example did not say it checked every byte"
  fail=1
fi

# The guide's C lines that are not lines of the program.
missing=$(awk -v src="$src" '
  function trim(s) { sub(/^[ \t]+/, "", s); sub(/[ \t]+$/, "", s); return s }
  BEGIN { while ((getline l < src) > 0) have[trim(l)] = 1 }
  /^```c[ \t]*$/ { inc = 1; next }
  /^```/ { inc = 0; next }
  inc { t = trim($0); if (t != "" && t != "..." && !(t in have)) printf "  docs/engine-guide.md:%d: %s\n", FNR, t }
' "$guide")
blocks=$(grep -c '^```c' "$guide")
if [ "$blocks" -eq 0 ]; then
  echo "docs/engine-guide.md has no \`\`\`c block to check"
  fail=1
fi
if [ -n "$missing" ]; then
  echo "lines of docs/engine-guide.md's C blocks that are not in tests/docs/engine_example.c:"
  echo "$missing"
  fail=1
fi

secs=$(( $(date +%s) - start ))
if [ $fail -eq 0 ]; then
  printf '  PASS  %-28s %5ss\n' "docs: engine guide example" "$secs"
else
  printf '  FAIL  %-28s %5ss\n' "docs: engine guide example" "$secs"
  exit 1
fi
