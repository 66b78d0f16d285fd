#!/usr/bin/env bash
# Stops the node that start.sh started in STATE_DIR and removes everything it put on the
# host, so that nothing is left running or mounted: the kube-scheduler and the kubelet (and
# its Node object, when the API server still answers); every
# container and pod sandbox (their tasks killed and deleted through containerd, which ends
# their shims); containerd and the node's registry; then any process still running one of
# the node's binaries or a runc container under STATE_DIR (SIGKILL); every mount under
# STATE_DIR (network namespaces, overlay snapshots, the kubelet's volumes), innermost
# first; the bridge and the iptables chain; then containerd's images and snapshots.
# Idempotent: what is already gone is skipped. Logs (and the registry's storage) stay in
# STATE_DIR.
#
# Usage: stop.sh STATE_DIR
set -uo pipefail

if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: $0 STATE_DIR" >&2
  exit 2
fi
[ -d "$1" ] || exit 0
state=$(cd "$1" && pwd)
[ -f "$state/env" ] || exit 0
# shellcheck disable=SC1091
. "$state/env"
bin=$LEASEHOLD_NODE_BIN

# is_ours PID NAME: PID is alive and runs bin/NAME.
is_ours() {
  local argv0
  kill -0 "$1" 2>/dev/null || return 1
  argv0=$(tr '\0' '\n' 2>/dev/null <"/proc/$1/cmdline" | head -n 1)
  [ "$(basename -- "${argv0:-none}")" = "$2" ]
}

# stop NAME: SIGTERM, up to 15 s, then SIGKILL.
stop() {
  local pid i
  pid=$(cat "$state/$1.pid" 2>/dev/null) || return 0
  if [ -n "$pid" ] && is_ours "$pid" "$1"; then
    kill -TERM "$pid" 2>/dev/null
    for ((i = 0; i < 150; i++)); do is_ours "$pid" "$1" || break; sleep 0.1; done
    if is_ours "$pid" "$1"; then
      kill -KILL "$pid" 2>/dev/null
      for ((i = 0; i < 50; i++)); do is_ours "$pid" "$1" || break; sleep 0.1; done
    fi
  fi
  rm -f "$state/$1.pid"
}

stop kube-scheduler
stop kubelet
# The Node object goes too (with it, the pods bound to it), so that no later pod is scheduled
# onto a node that no longer runs; best effort, the control plane may be gone already.
if [ -n "${LEASEHOLD_NODE_KUBECTL:-}" ] && [ -f "${LEASEHOLD_NODE_KUBECONFIG:-}" ]; then
  "$LEASEHOLD_NODE_KUBECTL" --kubeconfig "$LEASEHOLD_NODE_KUBECONFIG" --request-timeout=5s \
    delete node "$LEASEHOLD_NODE_NAME" --ignore-not-found --wait=false >/dev/null 2>&1
fi

# Every container and sandbox, through containerd while it still runs.
ctr=("$bin/ctr" --address "$state/containerd.sock" -n k8s.io)
if [ -S "$state/containerd.sock" ] && "${ctr[@]}" version >/dev/null 2>&1; then
  for task in $("${ctr[@]}" tasks ls -q 2>/dev/null); do
    "${ctr[@]}" tasks kill -a -s KILL "$task" >/dev/null 2>&1
  done
  for _ in $(seq 1 50); do
    [ -z "$("${ctr[@]}" tasks ls -q 2>/dev/null | head -n 1)" ] && break
    for task in $("${ctr[@]}" tasks ls -q 2>/dev/null); do
      "${ctr[@]}" tasks rm -f "$task" >/dev/null 2>&1
    done
    sleep 0.1
  done
  for c in $("${ctr[@]}" containers ls -q 2>/dev/null); do
    "${ctr[@]}" containers rm "$c" >/dev/null 2>&1
  done
fi
stop containerd
stop registry

# Whatever survived: shims of this node (they name its socket) and processes in its
# containers (their cwd or root lies under STATE_DIR's rootfs mounts).
for p in /proc/[0-9]*; do
  pid=${p#/proc/}
  cmd=$(tr '\0' ' ' 2>/dev/null <"$p/cmdline") || continue
  root=$(readlink "$p/root" 2>/dev/null) || root=
  case "$cmd|$root" in
    *"$state/containerd"* | *"|$state/"*) kill -KILL "$pid" 2>/dev/null ;;
  esac
done
sleep 0.2

# Mounts under STATE_DIR, innermost (longest path) first.
for _ in 1 2 3; do
  mounts=$(awk -v s="$state/" 'index($2, s) == 1 { print $2 }' /proc/self/mounts | sort -r | uniq)
  [ -n "$mounts" ] || break
  for m in $mounts; do
    umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null
  done
done

# The pods' cgroups, under the node's own cgroup root (in each cgroup v1 hierarchy, or the
# v2 tree), and any left under containerd's default k8s.io parent: only empty ones can be
# removed, so another runtime's are left alone.
for d in /sys/fs/cgroup/*/"$LEASEHOLD_NODE_NAME" /sys/fs/cgroup/"$LEASEHOLD_NODE_NAME" \
  /sys/fs/cgroup/*/k8s.io /sys/fs/cgroup/k8s.io; do
  [ -d "$d" ] || continue
  find "$d" -mindepth 1 -depth -type d -exec rmdir {} + 2>/dev/null
  rmdir "$d" 2>/dev/null
done

if [ -n "${LEASEHOLD_NODE_CHAIN:-}" ]; then
  while iptables -w -t nat -D PREROUTING -i "$LEASEHOLD_NODE_BRIDGE" -j "$LEASEHOLD_NODE_CHAIN" 2>/dev/null; do :; done
  iptables -w -t nat -F "$LEASEHOLD_NODE_CHAIN" 2>/dev/null
  iptables -w -t nat -X "$LEASEHOLD_NODE_CHAIN" 2>/dev/null
fi
if [ -n "${LEASEHOLD_NODE_BRIDGE:-}" ] && ip link show "$LEASEHOLD_NODE_BRIDGE" >/dev/null 2>&1; then
  ip link del "$LEASEHOLD_NODE_BRIDGE"
fi
mv "$state/env" "$state/env.stopped"

left=$(awk -v s="$state/" 'index($2, s) == 1 { print $2 }' /proc/self/mounts)
if [ -n "$left" ]; then
  echo "stop.sh: still mounted:" >&2
  echo "$left" >&2
  exit 1
fi
# containerd's content store and snapshots (the unpacked images, a few hundred MB) go; the
# logs stay.
rm -rf "$state/containerd/root" "$state/containerd/state" "$state/kubelet/pods"
exit 0
