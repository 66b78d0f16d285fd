#!/usr/bin/env bash
# Starts a real local Kubernetes control plane -- etcd, kube-apiserver and
# kube-controller-manager; no kubelet, no container engine -- listening on 127.0.0.1
# only, on free ports picked at random, with certificates, data and logs in STATE_DIR.
#
# Usage: start.sh STATE_DIR
#
# Writes STATE_DIR/kubeconfig (admin: client certificate in group system:masters)
# and STATE_DIR/env (KEY=VALUE lines: KUBECONFIG, LEASEHOLD_CONTROLPLANE_BIN, ports,
# pids; load it with `set -a; . STATE_DIR/env; set +a`). Waits for the API server's
# /readyz and for the `default` ServiceAccount (created by kube-controller-manager),
# then prints a one-line summary. A component that exits while it starts (its port
# taken meanwhile, or otherwise) is started again on other ports, a few times. On
# failure prints the tail of the failing log, stops what it started and exits non-zero. Each run starts an empty cluster.
# Stop it with stop.sh STATE_DIR.
#
# Environment: LEASEHOLD_CONTROLPLANE_BIN (bin dir; default: built by build.sh),
# LEASEHOLD_CONTROLPLANE_TIMEOUT (seconds to wait for readiness, default 120).
set -euo pipefail

if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: $0 STATE_DIR" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$1"
state=$(cd "$1" && pwd)
pki=$state/pki
timeout=${LEASEHOLD_CONTROLPLANE_TIMEOUT:-120}
components="etcd kube-apiserver kube-controller-manager"

# is_running NAME: true if STATE_DIR/NAME.pid names a live NAME process.
is_running() {
  local pid argv0
  pid=$(cat "$state/$1.pid" 2>/dev/null) || return 1
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  if [ -r "/proc/$pid/cmdline" ]; then
    argv0=$(tr '\0' '\n' <"/proc/$pid/cmdline" | head -n 1)
  else
    argv0=$(ps -p "$pid" -o stat=,command= | awk '$1 !~ /^Z/ { print $2 }')
  fi
  [ "$(basename -- "${argv0:-none}")" = "$1" ]
}

# has_exited NAME: true once the process launched as NAME is gone or a zombie. Unlike
# is_running it does not read the command line: between fork and exec a child still shows its
# parent's (bash), and a check made in that window took a starting etcd for one that had
# exited, with an empty log (a CI run failed so).
has_exited() {
  local pid stat
  pid=$(cat "$state/$1.pid" 2>/dev/null) || return 0
  kill -0 "$pid" 2>/dev/null || return 0
  stat=$(ps -p "$pid" -o stat= 2>/dev/null) || return 0
  case $stat in
  Z*) return 0 ;;
  esac
  return 1
}

for c in $components; do
  if is_running "$c"; then
    echo "start.sh: $c is already running from $state (pid $(cat "$state/$c.pid")); run stop.sh first" >&2
    exit 1
  fi
done

bin=${LEASEHOLD_CONTROLPLANE_BIN:-$("$here/build.sh" | tail -n 1)}
for c in $components kubectl; do
  [ -x "$bin/$c" ] || { echo "start.sh: $bin/$c is missing" >&2; exit 1; }
done
kubectl=("$bin/kubectl" --kubeconfig "$state/kubeconfig" --request-timeout=5s)

# From here on, any failure stops whatever was started.
finished=
cleanup() {
  local rc=$?
  if [ -z "$finished" ]; then
    "$here/stop.sh" "$state" >/dev/null 2>&1 || true
    [ "$rc" -ne 0 ] || rc=1
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

# fail MESSAGE [COMPONENT]: reports, shows the end of COMPONENT's log, exits.
fail() {
  echo "start.sh: $1" >&2
  if [ -n "${2:-}" ] && [ -s "$state/$2.log" ]; then
    echo "--- last 40 lines of $state/$2.log:" >&2
    tail -n 40 "$state/$2.log" >&2
  fi
  exit 1
}

# A fresh cluster every time: remove only what this script creates.
rm -rf "$state/etcd" "$pki" "$state/kubeconfig" "$state/env"
for c in $components; do
  rm -f "$state/$c.log" "$state/$c.pid" "$state/$c.args" "$state/$c.kubeconfig"
done

# ---- certificates and keys (openssl) -------------------------------------------------
mkdir -p "$pki"
chmod 700 "$pki"
ossl() { openssl "$@" 2>"$pki/openssl.err" || { cat "$pki/openssl.err" >&2; fail "openssl $1 failed"; }; }
newkey() { ossl genpkey -algorithm RSA -pkeyopt rsa_keygen_bits:2048 -out "$pki/$1.key"; }

cat >"$pki/ca.cnf" <<'EOF'
[req]
distinguished_name = dn
[dn]
[v3_ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign, digitalSignature
subjectKeyIdentifier = hash
EOF
# new_ca NAME CN: self-signed CA certificate.
new_ca() {
  newkey "$1"
  ossl req -x509 -new -key "$pki/$1.key" -subj "/CN=$2" -days 3650 \
    -config "$pki/ca.cnf" -extensions v3_ca -out "$pki/$1.crt"
}
new_ca ca leasehold-local-ca
# Separate CA for the front proxy (request-header authentication), as kubeadm does;
# without it kube-controller-manager keeps logging a missing requestheader CA bundle.
new_ca front-proxy-ca leasehold-local-front-proxy-ca

# issue NAME SUBJECT EXTENSIONS [CA]: key + certificate signed by CA (default: ca).
issue() {
  local ca=${4:-ca}
  newkey "$1"
  ossl req -new -key "$pki/$1.key" -subj "$2" -out "$pki/$1.csr"
  printf '%s\n' "basicConstraints = critical, CA:FALSE" \
    "keyUsage = critical, digitalSignature, keyEncipherment" \
    "subjectKeyIdentifier = hash" "authorityKeyIdentifier = keyid" "$3" >"$pki/$1.ext"
  ossl x509 -req -in "$pki/$1.csr" -CA "$pki/$ca.crt" -CAkey "$pki/$ca.key" \
    -set_serial "0x$(openssl rand -hex 16)" -days 365 -extfile "$pki/$1.ext" -out "$pki/$1.crt"
  rm -f "$pki/$1.csr" "$pki/$1.ext"
}
# 10.0.0.1 is the `kubernetes` Service's IP (the first of --service-cluster-ip-range), which
# pods on the node tests' node (tests/node) reach the API server by, as in-cluster clients do.
issue apiserver "/CN=kube-apiserver" "extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, IP:10.0.0.1, DNS:localhost, DNS:kubernetes, DNS:kubernetes.default, DNS:kubernetes.default.svc, DNS:kubernetes.default.svc.cluster.local"
issue admin "/O=system:masters/CN=leasehold-admin" "extendedKeyUsage = clientAuth"
issue kube-controller-manager "/CN=system:kube-controller-manager" "extendedKeyUsage = clientAuth"
issue front-proxy-client "/CN=front-proxy-client" "extendedKeyUsage = clientAuth" front-proxy-ca
# The API server's credentials towards kubelets (logs, exec), as kubeadm makes them; used only
# when tests/node runs a node.
issue apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" "extendedKeyUsage = clientAuth"
# Service-account token signing key pair.
newkey sa
ossl pkey -in "$pki/sa.key" -pubout -out "$pki/sa.pub"
rm -f "$pki/openssl.err" "$pki/ca.cnf"

b64() { base64 <"$1" | tr -d '\n'; }
# write_kubeconfig FILE USER: kubeconfig for the API server with USER's certificate.
write_kubeconfig() {
  cat >"$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: leasehold-local
  cluster:
    server: https://127.0.0.1:$api_port
    certificate-authority-data: $(b64 "$pki/ca.crt")
users:
- name: $2
  user:
    client-certificate-data: $(b64 "$pki/$2.crt")
    client-key-data: $(b64 "$pki/$2.key")
contexts:
- name: leasehold-local
  context:
    cluster: leasehold-local
    user: $2
    namespace: default
current-context: leasehold-local
EOF
  chmod 600 "$1"
}

# ---- ports ---------------------------------------------------------------------------
# pick_port: sets REPLY to a random port in 20000-31999 (below Linux's ephemeral
# range) that nothing accepts connections on and this run has not picked yet.
picked=" "
pick_port() {
  local p
  while :; do
    p=$((20000 + (RANDOM * 32768 + RANDOM) % 12000))
    case $picked in *" $p "*) continue ;; esac
    if (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; then continue; fi
    picked="$picked$p "
    REPLY=$p
    return
  done
}

# ---- processes -----------------------------------------------------------------------
# launch NAME ARGS...: starts bin/NAME in the background, logging to STATE_DIR/NAME.log;
# records its pid and its arguments (one per line, for restart-apiserver.sh).
launch() {
  local name=$1
  shift
  printf '%s\n' "$@" >"$state/$name.args"
  "$bin/$name" "$@" >"$state/$name.log" 2>&1 </dev/null &
  echo "$!" >"$state/$name.pid"
}

deadline=$((SECONDS + timeout))
early_exits=0
# wait_until NAME DESCRIPTION COMMAND...: polls COMMAND until it succeeds. Sets
# port_clash and returns if NAME exited because its port was taken meanwhile (the
# caller picks new ports); fails if NAME or an earlier component exited, or on timeout.
wait_until() {
  local name=$1 what=$2 c
  shift 2
  until "$@" >/dev/null 2>&1; do
    for c in $components; do
      [ -f "$state/$c.pid" ] || continue
      has_exited "$c" || continue
      if [ "$c" = "$name" ] && grep -q "address already in use" "$state/$c.log"; then
        port_clash=1
        return 0
      fi
      if [ "$c" = "$name" ] && [ "$early_exits" -lt 2 ]; then
        # The component just started exited: show why, and start it again (at most twice
        # more). A CI run once lost a fresh etcd with an empty log and no data directory.
        early_exits=$((early_exits + 1))
        echo "start.sh: $c exited while waiting for $what; starting it again. Its log:" >&2
        tail -n 20 "$state/$c.log" >&2 || true
        port_clash=1
        return 0
      fi
      fail "$c exited while waiting for $what" "$c"
    done
    [ "$SECONDS" -lt "$deadline" ] || fail "timed out after ${timeout}s waiting for $what" "$name"
    sleep 0.5
  done
}

# start_with_retry NAME: runs start_NAME, then its readiness wait; on a port clash,
# again with new ports (another control plane may have picked the same ones).
start_with_retry() {
  local attempt
  for attempt in 1 2 3 4 5; do
    port_clash=
    "start_$1"
    [ -n "$port_clash" ] || return 0
    echo "start.sh: $1: retrying with other ports" >&2
    rm -f "$state/$1.pid"
  done
  fail "$1: no free port after 5 attempts" "$1"
}

etcd_healthy() {
  (
    exec 3<>"/dev/tcp/127.0.0.1/$etcd_port"
    printf 'GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3
    timeout 5 cat <&3
  ) | grep -q '"health":"true"'
}

start_etcd() {
  pick_port
  etcd_port=$REPLY
  pick_port
  local peer_port=$REPLY
  rm -rf "$state/etcd"
  launch etcd \
    --name=leasehold \
    --data-dir="$state/etcd" \
    --listen-client-urls="http://127.0.0.1:$etcd_port" \
    --advertise-client-urls="http://127.0.0.1:$etcd_port" \
    --listen-peer-urls="http://127.0.0.1:$peer_port" \
    --initial-advertise-peer-urls="http://127.0.0.1:$peer_port" \
    --initial-cluster="leasehold=http://127.0.0.1:$peer_port" \
    --initial-cluster-state=new \
    --unsafe-no-fsync
  wait_until etcd "etcd /health" etcd_healthy
}

# --enable-aggregator-routing: the API server reaches a webhook's Service through its
# endpoints (pod IPs), not its ClusterIP, which nothing serves here (no kube-proxy). The
# node tests' pods (tests/node) serve the chart's admission webhook that way.
start_kube-apiserver() {
  pick_port
  api_port=$REPLY
  write_kubeconfig "$state/kubeconfig" admin
  launch kube-apiserver \
    --advertise-address=127.0.0.1 \
    --bind-address=127.0.0.1 \
    --secure-port="$api_port" \
    --endpoint-reconciler-type=none \
    --etcd-servers="http://127.0.0.1:$etcd_port" \
    --cert-dir="$pki" \
    --tls-cert-file="$pki/apiserver.crt" \
    --tls-private-key-file="$pki/apiserver.key" \
    --client-ca-file="$pki/ca.crt" \
    --authorization-mode=RBAC \
    --service-cluster-ip-range=10.0.0.0/24 \
    --service-account-issuer=https://kubernetes.default.svc.cluster.local \
    --service-account-key-file="$pki/sa.pub" \
    --service-account-signing-key-file="$pki/sa.key" \
    --allow-privileged=true \
    --enable-aggregator-routing=true \
    --shutdown-send-retry-after=true \
    --requestheader-client-ca-file="$pki/front-proxy-ca.crt" \
    --requestheader-allowed-names=front-proxy-client \
    --requestheader-username-headers=X-Remote-User \
    --requestheader-group-headers=X-Remote-Group \
    --requestheader-extra-headers-prefix=X-Remote-Extra- \
    --proxy-client-cert-file="$pki/front-proxy-client.crt" \
    --proxy-client-key-file="$pki/front-proxy-client.key" \
    --kubelet-client-certificate="$pki/apiserver-kubelet-client.crt" \
    --kubelet-client-key="$pki/apiserver-kubelet-client.key" \
    --kubelet-preferred-address-types=InternalIP,ExternalIP,Hostname
  wait_until kube-apiserver "kube-apiserver /readyz" "${kubectl[@]}" get --raw /readyz
}

start_kube-controller-manager() {
  pick_port
  kcm_port=$REPLY
  local kc=$state/kube-controller-manager.kubeconfig
  write_kubeconfig "$kc" kube-controller-manager
  launch kube-controller-manager \
    --kubeconfig="$kc" \
    --authentication-kubeconfig="$kc" \
    --authorization-kubeconfig="$kc" \
    --bind-address=127.0.0.1 \
    --secure-port="$kcm_port" \
    --leader-elect=false \
    --controllers='*' \
    --use-service-account-credentials=true \
    --service-account-private-key-file="$pki/sa.key" \
    --root-ca-file="$pki/ca.crt" \
    --cluster-signing-cert-file="$pki/ca.crt" \
    --cluster-signing-key-file="$pki/ca.key" \
    --service-cluster-ip-range=10.0.0.0/24
  wait_until kube-controller-manager "the default ServiceAccount" \
    "${kubectl[@]}" get serviceaccount default --namespace default
}

start_with_retry etcd
start_with_retry kube-apiserver
start_with_retry kube-controller-manager

cat >"$state/env" <<EOF
# Written by start.sh; load with: set -a; . $(printf %q "$state/env"); set +a
KUBECONFIG=$(printf %q "$state/kubeconfig")
LEASEHOLD_CONTROLPLANE_BIN=$(printf %q "$bin")
LEASEHOLD_CONTROLPLANE_STATE=$(printf %q "$state")
LEASEHOLD_APISERVER_URL=https://127.0.0.1:$api_port
LEASEHOLD_ETCD_URL=http://127.0.0.1:$etcd_port
LEASEHOLD_KCM_PORT=$kcm_port
ETCD_PID=$(cat "$state/etcd.pid")
KUBE_APISERVER_PID=$(cat "$state/kube-apiserver.pid")
KUBE_CONTROLLER_MANAGER_PID=$(cat "$state/kube-controller-manager.pid")
EOF

version=$("${kubectl[@]}" get --raw /version | sed -n 's/.*"gitVersion": *"\([^"]*\)".*/\1/p')
finished=1
echo "control plane ${version:-?} ready in ${SECONDS}s: kube-apiserver https://127.0.0.1:$api_port," \
  "etcd 127.0.0.1:$etcd_port, kube-controller-manager 127.0.0.1:$kcm_port;" \
  "KUBECONFIG=$state/kubeconfig"
