#!/bin/sh
# Check the manual pages: each renders without a single groff or man warning,
# names the version being built, and describes every option that the
# program's --help prints (and, for programs with commands or modes, every
# option of `PROGRAM COMMAND --help`).  Keeps the pages true to the help texts.
# Usage: tests/man/check.sh BUILD_DIR VERSION PAGE...
#   PAGE is <dir>/<program>.1; the program is BUILD_DIR/bin/<program>.
set -eu
build=$1 version=$2
shift 2
[ $# -eq 0 ] && { echo "  SKIP  manual pages: none"; exit 0; }
command -v groff >/dev/null || { echo "  SKIP  manual pages: groff is not installed"; exit 0; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
bad() { echo "  FAIL  $*"; fail=1; }

for page in "$@"; do
  prog=$(basename "$page" .1)
  bin="$build/bin/$prog"
  # 1. groff in its strictest mode, and man(1) as users run it.
  groff -man -Tutf8 -ww -z "$page" 2>"$tmp/groff" || true
  [ -s "$tmp/groff" ] && bad "$page: groff warnings:" && sed 's/^/        | /' "$tmp/groff"
  if command -v man >/dev/null; then
    MANWIDTH=80 man --warnings -E UTF-8 -l "$page" >/dev/null 2>"$tmp/man" || true
    [ -s "$tmp/man" ] && bad "$page: man warnings:" && sed 's/^/        | /' "$tmp/man"
  fi
  # 2. The version in the title line.
  grep -q "^\.TH .*\"segxfer $version\"" "$page" ||
    bad "$page: the .TH line does not say \"segxfer $version\""
  # 3. Every option of the help texts appears in the page (as roff writes
  #    it: \-\-name).
  [ -x "$bin" ] || { bad "$page: $bin is not built"; continue; }
  "$bin" --help >"$tmp/help" 2>&1 || true
  # Commands (sx-bench calls them modes): the first word of the lines after
  # "commands:" or "modes:" up to the next blank line, leaving out the
  # deeper-indented continuation lines of a description.
  cmds=$(awk '/^(commands|modes):/ {on=1; next} on && /^$/ {on=0} on && /^  [^ ]/ {print $1}' \
    "$tmp/help")
  for c in $cmds; do
    "$bin" "$c" --help >>"$tmp/help" 2>&1 || true
  done
  opts=$(grep -o -- '--[a-z][a-z0-9-]*' "$tmp/help" | sort -u)
  [ -n "$opts" ] || bad "$page: $bin --help printed no options"
  for o in $opts; do
    roff=$(printf '%s' "$o" | sed 's/-/\\\\-/g')
    grep -q -- "$roff" "$page" || bad "$page: option $o (in --help) is not described"
  done
  [ $fail -eq 0 ] && echo "  PASS  man page $page ($(echo "$opts" | wc -l) options)"
done
exit $fail
