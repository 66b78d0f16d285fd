#!/usr/bin/env bash
# Restarts one component of the control plane in STATE_DIR (started by start.sh):
# kube-apiserver or etcd. Stops the process (SIGTERM, or SIGNAL, e.g. KILL to simulate a
# crash), starts it again with the same flags and port (etcd keeps its data directory), and
# waits until it is ready again (kube-apiserver: /readyz; etcd: /health). The other
# components keep running and reconnect by themselves.
#
# Usage: restart.sh STATE_DIR COMPONENT [SIGNAL]
#
# Environment: LEASEHOLD_CONTROLPLANE_TIMEOUT (seconds to wait for readiness, default 120),
# LEASEHOLD_RESTART_DOWNTIME (seconds to stay down before starting again, default 0).
set -euo pipefail

if [ $# -lt 2 ] || [ $# -gt 3 ] || [ -z "$1" ]; then
  echo "usage: $0 STATE_DIR kube-apiserver|etcd [SIGNAL]" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
state=$(cd "$1" && pwd)
component=$2
timeout=${LEASEHOLD_CONTROLPLANE_TIMEOUT:-120}
case $component in
  kube-apiserver) pid_var=KUBE_APISERVER_PID ;;
  etcd) pid_var=ETCD_PID ;;
  *) echo "restart.sh: cannot restart $component (kube-apiserver or etcd)" >&2; exit 2 ;;
esac
for f in env "$component.args" kubeconfig; do
  [ -f "$state/$f" ] || { echo "restart.sh: no $state/$f; run start.sh first" >&2; exit 1; }
done
bin=$(. "$state/env" && printf %s "$LEASEHOLD_CONTROLPLANE_BIN")
args=()
while IFS= read -r arg; do args+=("$arg"); done <"$state/$component.args"
if [ "$component" = etcd ]; then
  # The data directory is kept: --initial-cluster-state=new is ignored when it holds a member.
  port=$(sed -n 's|^--listen-client-urls=http://127.0.0.1:||p' "$state/etcd.args")
else
  port=$(sed -n 's/^--secure-port=//p' "$state/kube-apiserver.args")
fi

ready() {
  if [ "$component" = etcd ]; then
    (
      exec 3<>"/dev/tcp/127.0.0.1/$port"
      printf 'GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
      timeout 5 cat <&3
    ) 2>/dev/null | grep -q '"health":"true"'
  else
    "$bin/kubectl" --kubeconfig "$state/kubeconfig" --request-timeout=5s \
      get --raw /readyz >/dev/null 2>&1
  fi
}

LEASEHOLD_STOP_SIGNAL=${3:-TERM} "$here/stop.sh" "$state" "$component"
sleep "${LEASEHOLD_RESTART_DOWNTIME:-0}"
# The port must be free again before the new process binds it.
for ((i = 0; i < 100; i++)); do
  (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || break
  sleep 0.1
done

"$bin/$component" "${args[@]}" >>"$state/$component.log" 2>&1 </dev/null &
pid=$!
echo "$pid" >"$state/$component.pid"
sed "s/^$pid_var=.*/$pid_var=$pid/" "$state/env" >"$state/env.tmp"
mv "$state/env.tmp" "$state/env"

deadline=$((SECONDS + timeout))
until ready; do
  if ! kill -0 "$pid" 2>/dev/null || [ "$SECONDS" -ge "$deadline" ]; then
    echo "restart.sh: $component did not become ready; last 40 lines of its log:" >&2
    tail -n 40 "$state/$component.log" >&2
    "$here/stop.sh" "$state" "$component" >/dev/null 2>&1 || true
    exit 1
  fi
  sleep 0.2
done
echo "$component restarted (pid $pid) and ready in ${SECONDS}s"
