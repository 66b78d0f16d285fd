#!/usr/bin/env bash
# Restarts the etcd of the control plane in STATE_DIR (started by start.sh): stops the
# process (SIGTERM, or SIGNAL, e.g. KILL to simulate a crash), starts it again with the same
# flags, port and data directory, and waits for its /health. kube-apiserver and
# kube-controller-manager keep running and reconnect by themselves.
#
# Usage: restart-etcd.sh STATE_DIR [SIGNAL]
#
# Environment: LEASEHOLD_CONTROLPLANE_TIMEOUT (seconds to wait for /health, default 120),
# LEASEHOLD_RESTART_DOWNTIME (seconds to stay down before starting again, default 0).
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ] || [ -z "$1" ]; then
  echo "usage: $0 STATE_DIR [SIGNAL]" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
state=$(cd "$1" && pwd)
timeout=${LEASEHOLD_CONTROLPLANE_TIMEOUT:-120}
for f in env etcd.args; do
  [ -f "$state/$f" ] || { echo "restart-etcd.sh: no $state/$f; run start.sh first" >&2; exit 1; }
done
bin=$(. "$state/env" && printf %s "$LEASEHOLD_CONTROLPLANE_BIN")
args=()
while IFS= read -r arg; do args+=("$arg"); done <"$state/etcd.args"
# The data directory is kept: --initial-cluster-state=new is ignored when it holds a member.
port=$(sed -n 's|^--listen-client-urls=http://127.0.0.1:||p' "$state/etcd.args")

LEASEHOLD_STOP_SIGNAL=${2:-TERM} "$here/stop.sh" "$state" etcd
sleep "${LEASEHOLD_RESTART_DOWNTIME:-0}"
# The port must be free again before the new process binds it.
for ((i = 0; i < 100; i++)); do
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || break
  sleep 0.1
done

"$bin/etcd" "${args[@]}" >>"$state/etcd.log" 2>&1 </dev/null &
pid=$!
echo "$pid" >"$state/etcd.pid"
sed "s/^ETCD_PID=.*/ETCD_PID=$pid/" "$state/env" >"$state/env.tmp"
mv "$state/env.tmp" "$state/env"

healthy() {
  (
    exec 3<>"/dev/tcp/127.0.0.1/$port"
    printf 'GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
    timeout 5 cat <&3
  ) 2>/dev/null | grep -q '"health":"true"'
}
deadline=$((SECONDS + timeout))
until healthy; do
  if ! kill -0 "$pid" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
    echo "restart-etcd.sh: etcd did not become healthy; last 40 lines of its log:" >&2
    tail -n 40 "$state/etcd.log" >&2
    "$here/stop.sh" "$state" etcd >/dev/null 2>&1 || true
    exit 1
  fi
  sleep 0.2
done
echo "etcd restarted (pid $pid) and healthy in ${SECONDS}s"
