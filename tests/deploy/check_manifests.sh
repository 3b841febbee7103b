#!/bin/sh
# Static checks of deploy/: Kubernetes manifests (parsed, checked against
# sx-agent's options and deploy/redis; `kubectl kustomize` when kubectl is
# installed), the systemd unit (`systemd-analyze verify`), the etcd files
# (every variable a flag etcd knows), the Dockerfile's runtime packages
# (apt-cache) and the shell scripts (shellcheck).  Each tool that is missing
# is reported as skipped, not failed.
# Usage: tests/deploy/check_manifests.sh BUILD_DIR
set -u
build=$1
repo=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail=0
done_list=""
skipped=""

"$build/bin/sx-agent" --help >"$tmp/agent-help" 2>&1
etcd_help=""
if command -v etcd >/dev/null; then
  etcd --help >"$tmp/etcd-help" 2>&1
  etcd_help="$tmp/etcd-help"
fi
if command -v python3 >/dev/null; then
  out=$(python3 "$repo/tests/deploy/check_manifests.py" "$repo" "$tmp/agent-help" $etcd_help)
  rc=$?
  [ -n "$out" ] && echo "$out"
  case "$out" in *SKIP*) skipped="$skipped yaml" ;; *) done_list="$done_list yaml" ;; esac
  [ $rc -eq 0 ] || fail=1
else
  skipped="$skipped yaml"
fi

if command -v kubectl >/dev/null; then
  if kubectl kustomize "$repo/deploy/k8s" >"$tmp/k8s.yaml" 2>"$tmp/k8s.err"; then
    done_list="$done_list kustomize"
  else
    echo "  FAIL  manifests: kubectl kustomize deploy/k8s:"; sed 's/^/        | /' "$tmp/k8s.err"
    fail=1
  fi
else
  skipped="$skipped kustomize"
fi

if command -v systemd-analyze >/dev/null; then
  # The unit as installed, pointing at the binary just built.
  sed "s#/usr/local/bin/sx-agent#$(cd "$build/bin" && pwd)/sx-agent#" \
    "$repo/deploy/systemd/sx-agent@.service" >"$tmp/sx-agent@.service"
  ln -s "sx-agent@.service" "$tmp/sx-agent@check.service"
  if systemd-analyze verify --man=no "$tmp/sx-agent@check.service" >"$tmp/sd.out" 2>&1 &&
     [ ! -s "$tmp/sd.out" ]; then
    done_list="$done_list systemd"
  else
    echo "  FAIL  manifests: systemd-analyze verify sx-agent@.service:"
    sed 's/^/        | /' "$tmp/sd.out"
    fail=1
  fi
else
  skipped="$skipped systemd"
fi

if command -v apt-cache >/dev/null; then
  pkgs=$(awk '/^FROM debian:12-slim$/ {rt=1} rt && /apt-get install/ {on=1; next}
              on && /&&/ {on=0}
              on { for (i = 1; i <= NF; i++) if ($i ~ /^[a-z0-9][a-z0-9.+-]+$/) print $i }' "$repo/deploy/k8s/Dockerfile" | sort -u)
  for p in $pkgs; do
    apt-cache show "$p" >/dev/null 2>&1 ||
      { echo "  FAIL  manifests: Dockerfile installs $p, which apt does not know"; fail=1; }
  done
  done_list="$done_list docker-packages"
else
  skipped="$skipped docker-packages"
fi

if command -v shellcheck >/dev/null; then
  if shellcheck -S warning "$repo/deploy/local-cluster.sh" >"$tmp/sc.out" 2>&1; then
    done_list="$done_list shellcheck"
  else
    echo "  FAIL  manifests: shellcheck deploy/local-cluster.sh:"; sed 's/^/        | /' "$tmp/sc.out"
    fail=1
  fi
else
  skipped="$skipped shellcheck"
fi

if [ $fail -eq 0 ]; then
  echo "  PASS  deploy/ checks:$done_list${skipped:+ (skipped, tool missing:$skipped)}"
fi
exit $fail
