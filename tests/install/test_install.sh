#!/bin/sh
# Install into a scratch DESTDIR, then build and run a program against the
# installed copy with nothing but `pkg-config --cflags --libs segxfer`, once
# against the shared library and once statically.
# Usage: tests/install/test_install.sh BUILD_DIR MAKE [EXTRA_CFLAGS]
# (EXTRA_CFLAGS carries -fsanitize=... for sanitizer builds.)
set -eu
build=$1 make=${2:-make} extra=${3:-}
dest=$(mktemp -d)
trap 'rm -rf "$dest"' EXIT
$make --no-print-directory install DESTDIR="$dest" PREFIX=/opt/segxfer BUILD="$build" >/dev/null
export PKG_CONFIG_SYSROOT_DIR="$dest" PKG_CONFIG_PATH="$dest/opt/segxfer/lib/pkgconfig"
here=$(dirname "$0")
# The SONAME is versioned and the unversioned link points at it.
objdump -p "$dest/opt/segxfer/lib/libsegxfer.so" | grep -q 'SONAME *libsegxfer.so.0' ||
  { echo "install: libsegxfer.so has no SONAME libsegxfer.so.0"; exit 1; }
# Only sx_* symbols are exported.
bad=$(nm -D --defined-only "$dest/opt/segxfer/lib/libsegxfer.so" | awk '$2 ~ /^[TDB]$/ && $3 !~ /^sx_/ {print $3}')
[ -z "$bad" ] || { echo "install: unexpected exported symbols: $bad"; exit 1; }
cc $extra -o "$dest/hello" "$here/hello.c" $(pkg-config --cflags --libs segxfer)
LD_LIBRARY_PATH="$dest/opt/segxfer/lib" "$dest/hello"
# Static libsegxfer, shared system libraries (what the .pc's Requires.private names).
cc $extra -o "$dest/hello-static" "$here/hello.c" $(pkg-config --cflags segxfer) \
  "$dest/opt/segxfer/lib/libsegxfer.a" \
  $(pkg-config --libs $(pkg-config --print-requires-private segxfer)) -lpthread -lm
"$dest/hello-static" >/dev/null
# The README's agent example, against the installed copy (in-process store).
cc $extra -o "$dest/agent_example" "$here/agent_example.c" $(pkg-config --cflags --libs segxfer)
LD_LIBRARY_PATH="$dest/opt/segxfer/lib" "$dest/agent_example" 2>/dev/null
echo "install: headers, libraries and segxfer.pc work from $dest (shared and static)"
