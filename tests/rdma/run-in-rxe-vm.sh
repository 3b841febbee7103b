#!/bin/bash
# run-in-rxe-vm.sh - run real libibverbs/librdmacm programs over Soft-RoCE (rdma_rxe)
# inside a throw-away QEMU VM booted from Debian's own kernel package.
#
# Usage: run-in-rxe-vm.sh <host-dir-with-payload> <command...>
#
#   The payload dir is shared read-write into the guest (virtio-9p) at /payload, which
#   is also the cwd and is first in PATH.  One argument => run as a shell command line
#   (dash: sh -c '...'); several arguments => run as an argv (each arg quoted as is).
#   Prints the guest console (command stdout+stderr, merged) on stdout, progress on
#   stderr, and exits with the guest command's exit status (125 if the host setup
#   failed - packages, kernel download - or the VM died / timed out / failed to set
#   up rxe0 before running it).
#
#   Inside the guest (kernel from Debian's linux-image-amd64, busybox initramfs, root):
#   rxe0 exists on eth0 (IPv4, MTU RXE_VM_MTU), all tools of ibverbs-utils,
#   rdmacm-utils, perftest, iproute2 (ip, rdma), bash, dash and busybox are on PATH,
#   and these are exported:
#     RXE_DEV=rxe0  RXE_NETDEV=eth0  RXE_IP=<own IPv4>  RXE_PEER_IP=<peer IPv4, or own>
#     RXE_ROLE=main|peer
#   Shared libraries needed by ELF files in the payload dir are found on the host with
#   ldd and packed into the guest automatically (payload must be built on this host /
#   for Debian 12).
#
# Environment knobs (all optional):
#   RXE_VM_CACHE=dir        build cache (default: <script dir>/cache)
#   RXE_VM_MEM=1024         guest RAM, MiB
#   RXE_VM_SMP=2            vCPUs (default 1 per VM when RXE_VM_PEER_CMD is set)
#   RXE_VM_ACCEL=tcg        tcg (default) | kvm (unusable on PVM-only hosts, see README.md here)
#   RXE_VM_TIMEOUT=3000     seconds before the VM(s) are killed (exit status 125)
#   RXE_VM_MTU=1500         eth0 MTU (>= 4200 gives RoCE active_mtu 4096, ~1.5x faster)
#   RXE_VM_PEER_CMD='...'   also boot a 2nd VM ("peer") that runs this shell command; the
#                           VMs are wired by a QEMU socket netdev (main 192.168.77.1, peer
#                           192.168.77.2).  The peer gets 10 s to finish after the main
#                           command ends, then it is killed.  Main's exit status is returned.
#   RXE_VM_PEER_NET=tcp     tcp (lossless, default) | udp (drops packets under load)
#   RXE_VM_EXTRA_FILES=".."  extra host files/dirs to copy into the guest (+ ldd deps of
#                           every ELF among them), e.g. "/usr/bin/strace" or
#                           "/usr/bin/python3.11 /usr/lib/python3.11" (no spaces in names)
#   RXE_VM_KERNEL_PKG=name  kernel package (default: what linux-image-amd64 depends on);
#                           e.g. linux-image-6.12.117+deb12-amd64 also works
#   RXE_VM_NO_APT=1         do not apt-get anything (fail if something is missing)
#   RXE_VM_QUIET=1          no progress lines        RXE_VM_VERBOSE=1  show boot messages
#   RXE_VM_APPEND='...'     extra kernel command line (e.g. loglevel=7)
#   RXE_VM_QEMU_EXTRA='...' extra qemu arguments (word-split)
#   RXE_VM_PVH=1            boot the uncompressed vmlinux via PVH (no faster under TCG)
set -euo pipefail

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
. "$SCRIPT_DIR/../support/servers.sh"  # sxt_free_port
CACHE=${RXE_VM_CACHE:-$SCRIPT_DIR/cache}
MEM=${RXE_VM_MEM:-1024}
SMP=${RXE_VM_SMP:-2}; [ -n "${RXE_VM_PEER_CMD:-}" ] && SMP=${RXE_VM_SMP:-1}  # 2 VMs on 2 host cores
ACCEL=${RXE_VM_ACCEL:-tcg}
TIMEOUT=${RXE_VM_TIMEOUT:-3000}
MTU=${RXE_VM_MTU:-1500}
T0=$(date +%s.%N)

log() { [ -n "${RXE_VM_QUIET:-}" ] || printf '[rxe-vm %6.1fs] %s\n' "$(awk -v a="$(date +%s.%N)" -v b="$T0" 'BEGIN{print a-b}')" "$*" >&2; }
die() { echo "run-in-rxe-vm: $*" >&2; exit 125; }

[ $# -ge 2 ] || { sed -n '2,50p' "$0" | sed -n '/^#/!q;p' >&2; exit 2; }
PAYLOAD=$(cd "$1" && pwd) || die "no such payload dir: $1"
shift
[ "$(id -u)" = 0 ] || die "must run as root (apt-get, dpkg-deb, 9p passthrough)"

# ---------------------------------------------------------------- 1. host packages
HOST_PKGS="qemu-system-x86 busybox-static cpio kmod xz-utils ibverbs-utils rdmacm-utils perftest ibverbs-providers libibverbs1 librdmacm1 iproute2"
need_install=""
for p in $HOST_PKGS; do
  dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q "install ok installed" || need_install="$need_install $p"
done
if [ -n "$need_install" ]; then
  [ -z "${RXE_VM_NO_APT:-}" ] || die "missing packages:$need_install"
  echo "[rxe-vm] apt-get install$need_install" >&2
  # Setup failures exit 125 (die), like a VM that never starts: callers tell
  # "cannot run here" from a failing guest command by that code.
  apt-get update -qq >&2 || die "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $need_install >/dev/null ||
    die "apt-get install$need_install failed"
fi
log "host packages ready"

# ---------------------------------------------------------------- 2. kernel
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"; flock 9   # concurrent invocations: one builds the cache, others wait
KPKG=${RXE_VM_KERNEL_PKG:-}
if [ -z "$KPKG" ]; then
  KPKG=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  if [ -z "$KPKG" ] && [ -z "${RXE_VM_NO_APT:-}" ]; then
    apt-get update -qq >&2 || die "apt-get update failed"
    KPKG=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  fi
fi
[ -n "$KPKG" ] || die "cannot determine kernel package"
KVER=${KPKG#linux-image-}; KVER=${KVER%-unsigned}
KDIR=$CACHE/kernel-$KVER
if [ ! -f "$KDIR/.done" ]; then
  log "downloading + extracting $KPKG"
  rm -rf "$KDIR"; mkdir -p "$KDIR/deb"
  (cd "$KDIR/deb" && apt-get download "$KPKG" >&2 2>/dev/null) || {
    [ -z "${RXE_VM_NO_APT:-}" ] && apt-get update -qq >&2 && (cd "$KDIR/deb" && apt-get download "$KPKG" >&2); } ||
    die "cannot download $KPKG"
  dpkg-deb --fsys-tarfile "$KDIR"/deb/*.deb | tar -x -C "$KDIR" ./boot ./lib/modules ||
    die "cannot extract $KPKG"
  rm -rf "$KDIR/deb"
  depmod -b "$KDIR" "$KVER"
  touch "$KDIR/.done"
fi
VMLINUZ=$KDIR/boot/vmlinuz-$KVER
# RXE_VM_PVH=1: boot the uncompressed ELF vmlinux through its PVH entry point (skips xz
# decompression; measured: no faster under TCG, so off by default).
if [ "${RXE_VM_PVH:-0}" = 1 ]; then
  if [ ! -s "$KDIR/vmlinux" ]; then
    off=$(LC_ALL=C grep -obUaP '\xfd7zXZ\x00' "$VMLINUZ" | head -1 | cut -d: -f1)
    if [ -n "$off" ] && tail -c +$((off + 1)) "$VMLINUZ" | xz -dc --single-stream > "$KDIR/vmlinux.tmp" 2>/dev/null &&
       head -c4 "$KDIR/vmlinux.tmp" | grep -q ELF; then mv "$KDIR/vmlinux.tmp" "$KDIR/vmlinux"; else rm -f "$KDIR/vmlinux.tmp"; fi
  fi
  [ -s "$KDIR/vmlinux" ] && VMLINUZ=$KDIR/vmlinux
fi
ls "$KDIR/lib/modules/$KVER/kernel/drivers/infiniband/sw/rxe/"rdma_rxe.ko* >/dev/null 2>&1 ||
  die "$KPKG has no rdma_rxe.ko (the -cloud flavour lacks it; use the generic amd64 flavour)"
log "kernel $KVER ready"

# ---------------------------------------------------------------- 3. base initramfs
# Kernel modules loaded at boot, in this order (dependencies resolved on the host).
MODULES="virtio_pci virtio_net 9pnet_virtio 9p crc32_generic ib_core ib_uverbs rdma_ucm rdma_rxe veth"
USER_PKGS="ibverbs-utils rdmacm-utils perftest ibverbs-providers libibverbs1 librdmacm1"
# libgcc_s: dlopen()ed by glibc for pthread_exit/pthread_cancel (rping aborts without it)
EXTRA_BINS="/usr/bin/rdma /usr/sbin/ip /usr/lib/x86_64-linux-gnu/libgcc_s.so.1 /bin/dash /bin/bash"
pkgver() { dpkg-query -W -f='${Package}=${Version} ' "$@"; }
KEY=$( { cat "$0"; pkgver $USER_PKGS iproute2 busybox-static libc6; echo "$KVER"; } | sha256sum | cut -c1-16)
BASE=$CACHE/base-$KVER-$KEY.cpio

copy_with_deps() {  # copy_with_deps ROOT file|dir...   (files + their ldd closure, paths kept)
  local root=$1 f l elves; shift
  for f in "$@"; do
    if [ -d "$f" ]; then  # whole tree in one go; then only its ELF candidates need ldd
      [ -e "$root$f" ] || { mkdir -p "$root$(dirname "$f")"; cp -a "$f" "$root$f"; }
      elves=$(find "$f" -type f \( -name '*.so*' -o -perm -u+x \))
    else
      [ -e "$root$f" ] || { mkdir -p "$root$(dirname "$f")"; cp -L "$f" "$root$f"; }
      elves=$f
    fi
    for e in $elves; do
      head -c4 "$e" 2>/dev/null | grep -q ELF || continue
      for l in $(ldd "$e" 2>/dev/null | awk '/=> \//{print $3} /^\t\/.*ld-linux/{print $1}'); do
        [ -e "$root$l" ] || { mkdir -p "$root$(dirname "$l")"; cp -L "$l" "$root$l"; }
      done
    done
  done
}

if [ ! -f "$BASE" ]; then
  log "building base initramfs"
  rm -rf "$CACHE"/root.* "$CACHE"/base-*.cpio
  R=$(mktemp -d "$CACHE/root.XXXXXX")
  mkdir -p "$R"/usr/{bin,sbin,lib,lib64} "$R"/{dev,proc,sys,tmp,run,etc,payload,root,mnt}
  ln -s usr/bin "$R/bin"; ln -s usr/sbin "$R/sbin"; ln -s usr/lib "$R/lib"; ln -s usr/lib64 "$R/lib64"
  cp /bin/busybox "$R/usr/bin/busybox"
  for a in $(busybox --list); do [ -e "$R/usr/bin/$a" ] || ln -s busybox "$R/usr/bin/$a"; done
  # /bin/sh must not be busybox: Debian's busybox sh runs its own applets (ip, ping...)
  # in preference to PATH, shadowing iproute2's ip etc.  Use dash instead.
  rm -f "$R/usr/bin/sh"
  # all files of the RDMA user-space packages (+ their ldd closure)
  files=$(dpkg -L $USER_PKGS | while read -r f; do if [ -f "$f" ]; then echo "$f"; fi; done | grep -v -E '^/usr/share/(doc|man|lintian)/')
  copy_with_deps "$R" $files $EXTRA_BINS
  ln -s dash "$R/usr/bin/sh"
  # soname symlinks of the libs (dpkg lists them as symlinks; ld.so wants the soname)
  for f in $(dpkg -L libibverbs1 librdmacm1 ibverbs-providers | grep -E '\.so\.[0-9]+$'); do
    [ -e "$R$f" ] || cp -L "$f" "$R$f"
  done
  mkdir -p "$R/usr/share/misc"; [ -f /usr/share/misc/pci.ids ] && cp -L /usr/share/misc/pci.ids "$R/usr/share/misc/" || true
  # kernel modules: closure of $MODULES in load order
  : > "$R/etc/rxe-modules"
  for m in $MODULES; do
    modprobe -d "$KDIR" -S "$KVER" --show-depends "$m" | awk '$1=="insmod"{print $2}' | while read -r ko; do
      rel=${ko#"$KDIR"/}; rel=${rel%.xz}   # 6.12 ships .ko.xz: store plain .ko for busybox insmod
      grep -qxF "/$rel" "$R/etc/rxe-modules" && continue
      echo "/$rel" >> "$R/etc/rxe-modules"; mkdir -p "$R/$(dirname "$rel")"
      case $ko in *.xz) xz -dc "$ko" > "$R/$rel";; *) cp "$ko" "$R/$rel";; esac
    done
  done
  cp "$KDIR/lib/modules/$KVER"/modules.{order,builtin,builtin.modinfo} "$R/lib/modules/$KVER/"
  depmod -b "$R" "$KVER"
  printf 'root:x:0:0:root:/root:/bin/sh\n' > "$R/etc/passwd"
  printf 'root:x:0:\n' > "$R/etc/group"
  printf '127.0.0.1 localhost\n192.168.77.1 rxe-main\n192.168.77.2 rxe-peer\n' > "$R/etc/hosts"
  printf 'hosts: files dns\n' > "$R/etc/nsswitch.conf"
  cat > "$R/init" <<'EOF'
#!/bin/sh
export PATH=/payload:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin HOME=/root
mount -t proc proc /proc; mount -t sysfs sys /sys; mount -t devtmpfs dev /dev
mkdir -p /dev/pts /dev/shm; mount -t devpts devpts /dev/pts; mount -t tmpfs tmp /dev/shm
mount -t tmpfs tmp /tmp; mount -t tmpfs run /run
exec </dev/console >/dev/console 2>&1
for kv in $(cat /proc/cmdline); do case $kv in rxe.*=*) k=${kv%%=*}; eval "RXE_${k#rxe.}=\${kv#*=}";; esac; done
fail() { echo "rxe-vm init: $*"; echo "@@RXE_VM_EXIT=125@@"; sync; poweroff -f; }
t0=$(cut -d' ' -f1 /proc/uptime)
for ko in $(cat /etc/rxe-modules); do insmod "$ko" || fail "insmod $ko"; done
ip link set lo up
ip link set eth0 mtu "$RXE_mtu" up || fail "no eth0"
ip addr add "$RXE_ip/24" dev eth0
rdma link add rxe0 type rxe netdev eth0 || fail "rdma link add rxe0 failed"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=none payload /payload || fail "9p mount"
i=0; while ! ibv_devices 2>/dev/null | grep -q rxe0; do i=$((i+1)); [ $i -gt 50 ] && fail "rxe0 not visible"; sleep 0.1; done
ulimit -l unlimited 2>/dev/null
echo; echo "@@RXE_VM_READY uptime=$(cut -d' ' -f1 /proc/uptime)s setup=${t0}s-> $(free -m | awk '/Mem:/{print "mem_used=" $3 "MiB buff/cache=" $6 "MiB"}')@@"
export RXE_DEV=rxe0 RXE_NETDEV=eth0 RXE_IP=$RXE_ip RXE_PEER_IP=$RXE_peer RXE_ROLE=$RXE_role
cd /payload
sh /rxe/cmd.sh
rc=$?
echo; echo "@@RXE_VM_DONE uptime=$(cut -d' ' -f1 /proc/uptime)s $(free -m | awk '/Mem:/{print "mem_used=" $3 "MiB buff/cache=" $6 "MiB"}')@@"
echo "@@RXE_VM_EXIT=$rc@@"
cd /; umount /payload 2>/dev/null; sync
poweroff -f
EOF
  chmod 755 "$R/init"
  (cd "$R" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc --quiet) > "$BASE.tmp"
  mv "$BASE.tmp" "$BASE"; rm -rf "$R"
  log "base initramfs: $(du -h "$BASE" | cut -f1)"
fi

flock -u 9
# ---------------------------------------------------------------- 4. per-run overlay cpio
RUN=$(mktemp -d /tmp/rxe-vm-run.XXXXXX)
PIDS=()
cleanup() {
  set +e; local f
  for f in "$RUN"/*.pid; do [ -s "$f" ] && kill "$(cat "$f")" 2>/dev/null; done
  for f in "${PIDS[@]:-}"; do [ -n "$f" ] && kill "$f" 2>/dev/null; done
  rm -rf "$RUN"; }
trap 'rc=$?; cleanup; exit $rc' EXIT
O=$RUN/overlay; mkdir -p "$O/rxe"
if [ $# -eq 1 ]; then printf '%s\n' "$1" > "$O/rxe/cmd.sh"
else printf '%q ' "$@" > "$O/rxe/cmd.sh"; echo >> "$O/rxe/cmd.sh"; fi
# libs needed by ELF files in the payload (and RXE_VM_EXTRA_FILES) that the base lacks
basefiles=$RUN/basefiles; cpio -t --quiet < "$BASE" | sed 's,^\./,,; s,^,/,' > "$basefiles"
libs=$(find "$PAYLOAD" -type f -size -256M 2>/dev/null | while read -r f; do
         if head -c4 "$f" 2>/dev/null | grep -q 'ELF'; then ldd "$f" 2>/dev/null | awk '/=> \//{print $3}' || true; fi; done | sort -u)
for l in $libs; do
  grep -qxF "${l/#\/lib\//\/usr\/lib\/}" "$basefiles" && continue
  mkdir -p "$O$(dirname "$l")"; cp -L "$l" "$O$l"
done
[ -n "${RXE_VM_EXTRA_FILES:-}" ] && copy_with_deps "$O" $RXE_VM_EXTRA_FILES
# merged-usr: anything that landed under /lib, /bin... must go to /usr/... (cpio must not replace symlinks)
for d in lib lib64 bin sbin; do [ -d "$O/$d" ] && { mkdir -p "$O/usr/$d"; cp -a "$O/$d/." "$O/usr/$d/"; rm -rf "${O:?}/$d"; }; done
(cd "$O" && find . -mindepth 1 | LC_ALL=C sort | cpio -o -H newc --quiet) > "$RUN/overlay.cpio"
cat "$BASE" "$RUN/overlay.cpio" > "$RUN/initrd.cpio"
log "overlay: $(du -h "$RUN/overlay.cpio" | cut -f1) (payload needs $(echo $libs | wc -w) libs, added: $(cd "$O" && find . -name '*.so*' | wc -l))"

# ---------------------------------------------------------------- 5. boot
ACCEL_OPTS=(-accel tcg,thread=multi -cpu max)
[ "$ACCEL" = kvm ] && ACCEL_OPTS=(-accel kvm -cpu host,-arch-capabilities)
qemu_args() {  # qemu_args role ip peer_ip mac netdev-args...   -> fills QARGS
  local role=$1 ip=$2 peer=$3 mac=$4; shift 4
  local initrd=$RUN/initrd.cpio
  [ "$role" = peer ] && initrd=$RUN/initrd-peer.cpio
  QARGS=(qemu-system-x86_64 ${RXE_VM_QEMU_EXTRA:-} -nodefaults -no-user-config -nographic -no-reboot "${ACCEL_OPTS[@]}"
    -m "$MEM" -smp "$SMP" -kernel "$VMLINUZ" -initrd "$initrd"
    -append "console=ttyS0 quiet panic=-1 rxe.ip=$ip rxe.peer=$peer rxe.role=$role rxe.mtu=$MTU ${RXE_VM_APPEND:-}"
    -serial stdio -monitor none -pidfile "$RUN/$role.pid"
    -virtfs "local,path=$PAYLOAD,mount_tag=payload,security_model=none,id=p0"
    -device "virtio-net-pci,netdev=n0,mac=$mac,romfile=,rx_queue_size=${RXE_VM_RXQ:-1024}" "$@")
}
console_filter() {  # console_filter main|peer  < raw serial console
  local role=$1 ready=${RXE_VM_VERBOSE:-} line blanks=0 pfx="" code
  [ "$role" = peer ] && pfx="[peer] "
  while IFS= read -r line; do
    line=${line%$'\r'}
    case $line in
      *@@RXE_VM_READY*) ready=1; blanks=0; log "$role guest ready: ${line//@/}"; continue;;
      *@@RXE_VM_DONE*)  blanks=0; log "$role guest command finished: ${line//@/}"; continue;;
      *@@RXE_VM_EXIT=*) blanks=0; code=${line#*@@RXE_VM_EXIT=}; code=${code%%@@*}
                        [ "$role" = main ] && echo "$code" > "$RUN/exit" || log "peer exit status $code"; continue;;
      *"] reboot: Power down"|*"terminating on signal"*) continue;;
    esac
    if [ -z "$ready" ]; then printf '%s\n' "$line" >> "$RUN/$role-boot.log"; continue; fi
    if [ -z "$line" ]; then blanks=$((blanks + 1)); continue; fi  # drop the blank line before a marker
    while [ $blanks -gt 0 ]; do printf '%s\n' "$pfx"; blanks=$((blanks - 1)); done
    printf '%s%s\n' "$pfx" "$line"
  done
  if [ -z "$ready" ]; then echo "---- $role guest boot log (never became ready) ----"; cat "$RUN/$role-boot.log" 2>/dev/null; fi >&2
}
if [ -n "${RXE_VM_PEER_CMD:-}" ]; then
  # peer initrd: same as main, plus a third cpio that replaces /rxe/cmd.sh by the peer command
  mkdir -p "$RUN/peer/rxe"; printf '%s\n' "$RXE_VM_PEER_CMD" > "$RUN/peer/rxe/cmd.sh"
  (cd "$RUN/peer" && find . -mindepth 1 | cpio -o -H newc --quiet) > "$RUN/peer.cpio"
  cat "$RUN/initrd.cpio" "$RUN/peer.cpio" > "$RUN/initrd-peer.cpio"
  # Ports the kernel gave out, as tests running beside this one (servers on
  # kernel-given ports too) may take one first: the peer counts as
  # listening only once ss names its own qemu on the port, else another
  # port is tried.
  for try in 1 2 3; do
    P1=$(sxt_free_port); P2=$(sxt_free_port)
    if [ "${RXE_VM_PEER_NET:-tcp}" = udp ]; then  # lossy: drops under load -> RC retransmit stalls
      PEER_NET="socket,id=n0,udp=127.0.0.1:$P1,localaddr=127.0.0.1:$P2"
      MAIN_NET="socket,id=n0,udp=127.0.0.1:$P2,localaddr=127.0.0.1:$P1"
    else  # TCP stream: lossless, back-pressured; peer listens, main connects
      PEER_NET="socket,id=n0,listen=127.0.0.1:$P1"
      MAIN_NET="socket,id=n0,connect=127.0.0.1:$P1"
    fi
    rm -f "$RUN/peer.pid"
    qemu_args peer 192.168.77.2 192.168.77.1 52:54:00:12:34:02 -netdev "$PEER_NET"
    ( timeout "$TIMEOUT" "${QARGS[@]}" </dev/null 2>&1 | console_filter peer >&2 ) &
    peer_sub=$!
    PIDS+=($peer_sub)
    [ "${RXE_VM_PEER_NET:-tcp}" = udp ] && break
    listening=  # wait for the peer's qemu to listen (no probe connect!)
    for _ in $(seq 100); do
      qpid=$(cat "$RUN/peer.pid" 2>/dev/null || true)
      if [ -n "$qpid" ] && ss -Hltnp "sport = :$P1" | grep -q "pid=$qpid,"; then
        listening=1
        break
      fi
      kill -0 "$peer_sub" 2>/dev/null || break
      sleep 0.1
    done
    [ -n "$listening" ] && break
    log "the peer VM's qemu is not listening on 127.0.0.1:$P1 (taken?): try $try of 3 failed"
    [ -s "$RUN/peer.pid" ] && kill "$(cat "$RUN/peer.pid")" 2>/dev/null || true
    kill "$peer_sub" 2>/dev/null || true
    wait "$peer_sub" 2>/dev/null || true
    [ "$try" = 3 ] && { log "giving up: no port for the link between the VMs"; exit 1; }
  done
  qemu_args main 192.168.77.1 192.168.77.2 52:54:00:12:34:01 -netdev "$MAIN_NET"
else
  qemu_args main 10.0.2.15 10.0.2.15 52:54:00:12:34:01 -netdev user,id=n0,restrict=on
fi
log "booting VM ($ACCEL, ${MEM} MiB, $SMP vCPU)"
qrc=0; timeout "$TIMEOUT" "${QARGS[@]}" </dev/null 2>&1 | console_filter main || qrc=$?
if [ -n "${RXE_VM_PEER_CMD:-}" ]; then  # give the peer a few seconds to finish by itself
  for _ in $(seq 100); do [ -s "$RUN/peer.pid" ] && kill -0 "$(cat "$RUN/peer.pid")" 2>/dev/null || break; sleep 0.1; done
fi
rc=125
[ -s "$RUN/exit" ] && rc=$(tr -dc 0-9 < "$RUN/exit")
[ "$qrc" = 124 ] && log "TIMEOUT: VM killed after ${TIMEOUT}s (RXE_VM_TIMEOUT)"
[ "$qrc" != 0 ] && [ "$qrc" != 124 ] && log "qemu exited with status $qrc"
log "VM finished, exit status $rc"
exit "$rc"
