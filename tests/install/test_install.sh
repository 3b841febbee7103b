#!/bin/sh
# Install into a scratch DESTDIR, then build and run a program against the
# installed copy with nothing but `pkg-config --cflags --libs segxfer`, once
# against the shared library and once statically; check that every installed
# program has its manual page and that `make uninstall` removes every file
# that install put there.
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
# Programs and their manual pages, which render from where they were put.
prefix="$dest/opt/segxfer"
for p in sx-agent sxctl; do
  [ -x "$prefix/bin/$p" ] || { echo "install: $p is not installed"; exit 1; }
done
for p in "$prefix"/bin/*; do
  p=$(basename "$p")
  page="$prefix/share/man/man1/$p.1"
  [ -f "$page" ] || { echo "install: $p has no manual page ($page)"; exit 1; }
  if command -v man >/dev/null; then
    out=$(MANWIDTH=80 man --warnings -E UTF-8 -l "$page" 2>&1 >/dev/null)
    [ -z "$out" ] || { echo "install: man $page warns: $out"; exit 1; }
    MANWIDTH=80 man -E UTF-8 -l "$page" 2>/dev/null | grep -q "^NAME" ||
      { echo "install: man -l $page renders nothing"; exit 1; }
  fi
done
pages=$(ls "$prefix/share/man/man1" | tr '\n' ' ')
# The Python package and its start-up hook: segxfer.pth lies in the site
# directory and does nothing unless SEGXFER_LMDEPLOY is set; set, it waits for
# LMDeploy's backend package; a bad value is a warning, never a failed start.
py=${PYTHON:-/usr/bin/python3}
pydir=$(ls -d "$prefix"/lib/python3*/dist-packages)
for f in segxfer.pth _segxfer_hook.py segxfer/lmdeploy_backend.py segxfer-sglang.pth \
    _segxfer_sglang_hook.py; do
  [ -f "$pydir/$f" ] || { echo "install: $f is missing from $pydir"; exit 1; }
done
probe="import site, sys; site.addsitedir('$pydir'); print(*sorted(type(f).__name__ for f in sys.meta_path if type(f).__module__ == '_segxfer_hook'), '_segxfer_hook' in sys.modules)"
out=$(env -u SEGXFER_LMDEPLOY -u SEGXFER_SGLANG "$py" -c "$probe" 2>&1)
[ "$out" = "False" ] || { echo "install: segxfer.pth acts without SEGXFER_LMDEPLOY: $out"; exit 1; }
out=$(SEGXFER_LMDEPLOY=Mooncake "$py" -c "$probe" 2>&1)
[ "$out" = "_Finder True" ] || { echo "install: segxfer.pth with SEGXFER_LMDEPLOY=Mooncake: $out"; exit 1; }
out=$(SEGXFER_LMDEPLOY='no such' "$py" -c "$probe" 2>&1)
case $out in *"is not a backend name"*True) ;; *)
  echo "install: SEGXFER_LMDEPLOY='no such' gives no clear warning: $out"; exit 1;; esac
# The SGLang hook (segxfer-sglang.pth) uses _segxfer_hook's machinery from
# the same directory: one finder, waiting for SGLang's disaggregation utils.
sgl="import site, sys; site.addsitedir('$pydir'); print(*[f.fullname for f in sys.meta_path if type(f).__module__ == '_segxfer_hook'])"
out=$(env -u SEGXFER_LMDEPLOY SEGXFER_SGLANG=mooncake "$py" -c "$sgl" 2>&1)
[ "$out" = "sglang.srt.disaggregation.utils" ] ||
  { echo "install: segxfer-sglang.pth with SEGXFER_SGLANG=mooncake: $out"; exit 1; }
# Uninstall leaves no file or link behind (empty standard directories may stay).
$make --no-print-directory uninstall DESTDIR="$dest" PREFIX=/opt/segxfer BUILD="$build" >/dev/null
left=$(find "$prefix" \( -type f -o -type l \) -print)
[ -z "$left" ] || { echo "install: uninstall left behind:"; echo "$left"; exit 1; }
[ ! -d "$prefix/include/segxfer" ] || { echo "install: uninstall left include/segxfer"; exit 1; }
echo "install: headers, libraries and segxfer.pc work from $dest (shared and static); man pages $pages; the Python package and segxfer.pth hook; uninstall removed every file"
