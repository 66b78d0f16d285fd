#!/usr/bin/env bash
# Restarts the kube-apiserver of the control plane in STATE_DIR (started by start.sh):
# stops the process (SIGTERM, or SIGNAL, e.g. KILL to simulate a crash), starts it
# again with the same flags and port, and waits for /readyz. etcd and
# kube-controller-manager keep running.
#
# Usage: restart-apiserver.sh STATE_DIR [SIGNAL]
#
# Environment: LEASEHOLD_CONTROLPLANE_TIMEOUT (seconds to wait for /readyz, default 120),
# LEASEHOLD_RESTART_DOWNTIME (seconds to stay down before starting again, default 0).
set -euo pipefail

if [ $# -lt 1 ] || [ $# -gt 2 ] || [ -z "$1" ]; then
  echo "usage: $0 STATE_DIR [SIGNAL]" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
state=$(cd "$1" && pwd)
timeout=${LEASEHOLD_CONTROLPLANE_TIMEOUT:-120}
for f in env kube-apiserver.args kubeconfig; do
  [ -f "$state/$f" ] || { echo "restart-apiserver.sh: no $state/$f; run start.sh first" >&2; exit 1; }
done
bin=$(. "$state/env" && printf %s "$LEASEHOLD_CONTROLPLANE_BIN")
args=()
while IFS= read -r arg; do args+=("$arg"); done <"$state/kube-apiserver.args"

port=$(sed -n 's/^--secure-port=//p' "$state/kube-apiserver.args")

LEASEHOLD_STOP_SIGNAL=${2:-TERM} "$here/stop.sh" "$state" kube-apiserver
sleep "${LEASEHOLD_RESTART_DOWNTIME:-0}"
# The port must be free again before the new process binds it.
for ((i = 0; i < 100; i++)); do
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || break
  sleep 0.1
done

"$bin/kube-apiserver" "${args[@]}" >>"$state/kube-apiserver.log" 2>&1 </dev/null &
pid=$!
echo "$pid" >"$state/kube-apiserver.pid"
sed "s/^KUBE_APISERVER_PID=.*/KUBE_APISERVER_PID=$pid/" "$state/env" >"$state/env.tmp"
mv "$state/env.tmp" "$state/env"

deadline=$((SECONDS + timeout))
until "$bin/kubectl" --kubeconfig "$state/kubeconfig" --request-timeout=5s \
  get --raw /readyz >/dev/null 2>&1; do
  if ! kill -0 "$pid" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
    echo "restart-apiserver.sh: kube-apiserver did not become ready; last 40 lines of its log:" >&2
    tail -n 40 "$state/kube-apiserver.log" >&2
    "$here/stop.sh" "$state" kube-apiserver >/dev/null 2>&1 || true
    exit 1
  fi
  sleep 0.2
done
echo "kube-apiserver restarted (pid $pid) and ready in ${SECONDS}s"
