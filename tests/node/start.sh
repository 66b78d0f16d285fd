#!/usr/bin/env bash
# Starts a real Kubernetes node beside the control plane that tests/controlplane/start.sh
# started in CONTROLPLANE_STATE: containerd (CRI, Debian's runc as the runtime, the CNI
# loopback and bridge plugins), the kubelet, and a kube-scheduler, with everything they
# write under STATE_DIR. Pods get their own network namespace on a bridge this script
# creates (10.89.N.0/24, N picked at random among the free ones); the one Service pods need,
# `kubernetes` (10.0.0.1:443), is carried to the API server on loopback by an iptables DNAT
# rule in a chain of this node's own (what kube-proxy would do for it). The sandbox
# ("pause") image is built here FROM scratch and pinned, and each IMAGE_ARCHIVE
# (docker-archive or oci-archive) is imported into containerd's k8s.io namespace. Beside
# them the node has a registry of its own: an OCI registry (distribution's `registry serve`,
# tests/tools/registry) on 127.0.0.1 at a free port, plain HTTP, storing under
# STATE_DIR/registry, which containerd pulls from (its CRI registry hosts directory,
# STATE_DIR/containerd/certs.d, names it as a plain-HTTP mirror of itself). It starts
# empty: tests push images and charts to it and install from it.
#
# Usage: start.sh STATE_DIR CONTROLPLANE_STATE [IMAGE_ARCHIVE...]
#
# Needs root, Debian's runc (seccomp-enabled), podman (for the sandbox image), iptables and
# iproute2. Writes STATE_DIR/env (KEY=VALUE: LEASEHOLD_NODE_NAME, LEASEHOLD_NODE_BIN,
# LEASEHOLD_NODE_SOCKET (containerd's, for ctr), LEASEHOLD_NODE_REGISTRY (host:port of the
# registry), the pod subnet, pids). Waits until the registry answers, the Node is Ready and
# the scheduler is healthy. On failure prints the tail of the failing log, stops what it
# started and exits non-zero. Stop it with stop.sh STATE_DIR.
#
# Environment: LEASEHOLD_NODE_BIN (bin dir; default: built by build.sh),
# LEASEHOLD_REGISTRY_BIN (the registry binary; default: built by
# tests/tools/registry/build.sh), LEASEHOLD_NODE_TIMEOUT (seconds to wait for readiness,
# default 120).
set -euo pipefail

if [ $# -lt 2 ] || [ -z "$1" ] || [ -z "$2" ]; then
  echo "usage: $0 STATE_DIR CONTROLPLANE_STATE [IMAGE_ARCHIVE...]" >&2
  exit 2
fi
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$1"
state=$(cd "$1" && pwd)
cp_state=$(cd "$2" && pwd)
shift 2
timeout=${LEASEHOLD_NODE_TIMEOUT:-120}
export CONTAINERS_CONF=${CONTAINERS_CONF:-$here/../../scripts/containers.conf}

[ "$(id -u)" = 0 ] || { echo "start.sh: the node needs root (containerd, runc, mounts, iptables)" >&2; exit 1; }
runc=$(command -v runc || true)
[ -n "$runc" ] || { echo "start.sh: no runc on PATH (apt-get install runc)" >&2; exit 1; }
for tool in podman iptables ip; do
  command -v "$tool" >/dev/null || { echo "start.sh: $tool is missing" >&2; exit 1; }
done
[ -f "$cp_state/env" ] || { echo "start.sh: no control plane in $cp_state" >&2; exit 1; }
# shellcheck disable=SC1091
cp_bin=$(. "$cp_state/env" && printf %s "$LEASEHOLD_CONTROLPLANE_BIN")
# shellcheck disable=SC1091
api_url=$(. "$cp_state/env" && printf %s "$LEASEHOLD_APISERVER_URL")
api_port=${api_url##*:}
kubeconfig=$cp_state/kubeconfig
kubectl=("$cp_bin/kubectl" --kubeconfig "$kubeconfig" --request-timeout=5s)

if [ -f "$state/env" ]; then
  echo "start.sh: a node is recorded in $state/env; run stop.sh $state first" >&2
  exit 1
fi
bin=${LEASEHOLD_NODE_BIN:-$("$here/build.sh" | tail -n 1)}
for c in kubelet kube-scheduler containerd containerd-shim-runc-v2 ctr loopback bridge host-local pause; do
  [ -x "$bin/$c" ] || { echo "start.sh: $bin/$c is missing" >&2; exit 1; }
done
registry_bin=${LEASEHOLD_REGISTRY_BIN:-$("$here/../tools/registry/build.sh" | tail -n 1)}
[ -x "$registry_bin" ] || { echo "start.sh: $registry_bin is missing" >&2; exit 1; }

# A short id for names this node creates on the host (bridge, iptables chain).
id=$(od -An -N2 -tx2 /dev/urandom | tr -d ' \n')
node=leasehold-node-$id
bridge=lhbr$id
chain=LEASEHOLD-NODE-$id
# A pod subnet that no route uses yet.
for _ in $(seq 1 50); do
  n=$((RANDOM % 200 + 20))
  ip route show | grep -q "^10\.89\.$n\." || break
done
subnet=10.89.$n.0/24
gateway=10.89.$n.1

# The env file is written first (and completed at the end), so that stop.sh can undo a
# partial start.
cat >"$state/env" <<EOF
# Written by start.sh; load with: set -a; . $(printf %q "$state/env"); set +a
LEASEHOLD_NODE_STATE=$(printf %q "$state")
LEASEHOLD_NODE_BIN=$(printf %q "$bin")
LEASEHOLD_NODE_NAME=$node
LEASEHOLD_NODE_BRIDGE=$bridge
LEASEHOLD_NODE_CHAIN=$chain
LEASEHOLD_NODE_SUBNET=$subnet
LEASEHOLD_NODE_SOCKET=$(printf %q "$state/containerd.sock")
LEASEHOLD_NODE_KUBECTL=$(printf %q "$cp_bin/kubectl")
LEASEHOLD_NODE_KUBECONFIG=$(printf %q "$kubeconfig")
EOF

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

fail() {
  echo "start.sh: $1" >&2
  if [ -n "${2:-}" ] && [ -s "$state/$2.log" ]; then
    echo "--- last 40 lines of $state/$2.log:" >&2
    tail -n 40 "$state/$2.log" >&2
  fi
  exit 1
}

launch() {
  local name=$1
  shift
  "$@" >"$state/$name.log" 2>&1 </dev/null &
  echo "$!" >"$state/$name.pid"
}

deadline=$((SECONDS + timeout))
wait_until() {
  local name=$1 what=$2
  shift 2
  until "$@" >/dev/null 2>&1; do
    kill -0 "$(cat "$state/$name.pid")" 2>/dev/null || fail "$name exited while waiting for $what" "$name"
    [ "$SECONDS" -lt "$deadline" ] || fail "timed out after ${timeout}s waiting for $what" "$name"
    sleep 0.5
  done
}

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

# ---- network: the pods' bridge and the `kubernetes` Service ----------------------------
ip link add "$bridge" type bridge
ip addr add "$gateway/24" dev "$bridge"
ip link set "$bridge" up
# Pods reach the API server, which listens on 127.0.0.1 only, through the Service IP: DNAT
# to loopback, which the kernel routes for packets from this bridge only with route_localnet.
echo 1 >"/proc/sys/net/ipv4/conf/$bridge/route_localnet"
iptables -w -t nat -N "$chain"
iptables -w -t nat -A "$chain" -d 10.0.0.1/32 -p tcp --dport 443 \
  -j DNAT --to-destination "127.0.0.1:$api_port"
iptables -w -t nat -I PREROUTING -i "$bridge" -j "$chain"

# ---- the registry -----------------------------------------------------------------------
pick_port
registry=127.0.0.1:$REPLY
mkdir -p "$state/registry/data"
cat >"$state/registry/config.yml" <<EOF
version: 0.1
log:
  level: info
storage:
  filesystem:
    rootdirectory: $state/registry/data
  delete:
    enabled: true
http:
  addr: $registry
  secret: $(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
EOF
# No tracing exporter (distribution would send spans to an OTLP collector on localhost).
launch registry env OTEL_TRACES_EXPORTER=none "$registry_bin" serve \
  "$state/registry/config.yml"
echo "LEASEHOLD_NODE_REGISTRY=$registry" >>"$state/env"
wait_until registry "the registry at $registry" curl -sf "http://$registry/v2/"

# ---- containerd ------------------------------------------------------------------------
mkdir -p "$state/cni/conf" "$state/cni/bin" "$state/containerd"
# Pulls from the node's registry go over plain HTTP (the hosts directory is read at each pull).
mkdir -p "$state/containerd/certs.d/$registry"
cat >"$state/containerd/certs.d/$registry/hosts.toml" <<EOF
server = "http://$registry"

[host."http://$registry"]
  capabilities = ["pull", "resolve"]
EOF
cp "$bin/loopback" "$bin/bridge" "$bin/host-local" "$state/cni/bin/"
cat >"$state/cni/conf/10-leasehold.conflist" <<EOF
{
  "cniVersion": "1.0.0",
  "name": "leasehold-pods",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "$bridge",
      "isGateway": true,
      "ipMasq": false,
      "ipam": {
        "type": "host-local",
        "dataDir": "$state/cni/ipam",
        "ranges": [[{"subnet": "$subnet", "gateway": "$gateway"}]],
        "routes": [{"dst": "0.0.0.0/0"}]
      }
    },
    {"type": "loopback"}
  ]
}
EOF
sandbox=localhost/leasehold-pause:$(basename "$(dirname "$bin")")
cat >"$state/containerd/config.toml" <<EOF
version = 3
root = "$state/containerd/root"
state = "$state/containerd/state"

[grpc]
  address = "$state/containerd.sock"

[ttrpc]
  address = "$state/containerd.ttrpc.sock"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = 'overlayfs'
  [plugins.'io.containerd.cri.v1.images'.registry]
    config_path = '$state/containerd/certs.d'
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = '$sandbox'

[plugins.'io.containerd.cri.v1.runtime']
  # This VM refuses a negative oom_score_adj; without this every pod sandbox fails with
  # runc's "can't get final child's PID from pipe".
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = 'runc'
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = 'io.containerd.runc.v2'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        # Debian's runc: one built from Go modules lacks seccomp ("config provided but
        # seccomp not supported").
        BinaryName = '$runc'
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ['$state/cni/bin']
    conf_dir = '$state/cni/conf'
    max_conf_num = 1

[plugins.'io.containerd.grpc.v1.cri']
  disable_tcp_service = true
  stream_server_address = '127.0.0.1'
  stream_server_port = '0'
EOF
launch containerd env PATH="$bin:$PATH" "$bin/containerd" --config "$state/containerd/config.toml"
ctr=("$bin/ctr" --address "$state/containerd.sock" -n k8s.io)
wait_until containerd "containerd's socket" "${ctr[@]}" version

# The sandbox image: the pause program alone, FROM scratch, built once per node build.
pause_archive=$(dirname "$bin")/pause.tar
if [ ! -s "$pause_archive" ]; then
  ctx=$(mktemp -d "${TMPDIR:-/tmp}/leasehold-pause.XXXXXX")
  cp "$bin/pause" "$ctx/pause"
  printf 'FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n' >"$ctx/Containerfile"
  podman build -q --no-cache -t "$sandbox" "$ctx" >/dev/null
  podman save -q --format docker-archive -o "$pause_archive.tmp" "$sandbox"
  podman rmi "$sandbox" >/dev/null
  mv "$pause_archive.tmp" "$pause_archive"
  rm -rf "$ctx"
fi
for archive in "$pause_archive" "$@"; do
  "${ctr[@]}" images import "$archive" >>"$state/import.log" 2>&1 \
    || fail "ctr images import $archive failed" import
done
# Pinned, so that the kubelet's image garbage collection never removes them.
for ref in $("${ctr[@]}" images ls -q 2>/dev/null | grep -v '^sha256:'); do
  "${ctr[@]}" images label "$ref" io.cri-containerd.pinned=pinned >/dev/null 2>&1
done

# ---- kubelet ---------------------------------------------------------------------------
pick_port
kubelet_port=$REPLY
pick_port
healthz_port=$REPLY
mkdir -p "$state/kubelet" "$state/pod-logs"
cat >"$state/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# This machine's cgroups are v1 (hybrid) and unmanaged by systemd. Pods get the usual pod
# and QoS cgroups, under a root of this node's own (removed by stop.sh).
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupsPerQOS: true
cgroupRoot: /$node
enforceNodeAllocatable: ["pods"]
failSwapOn: false
containerRuntimeEndpoint: unix://$state/containerd.sock
# The node's address is the pods' gateway, on the bridge this script made: the kubelet
# refuses a loopback node IP, and the API server reaches it there for logs and exec.
address: $gateway
port: $kubelet_port
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: $healthz_port
podLogsDir: $state/pod-logs
authentication:
  anonymous: {enabled: false}
  webhook: {enabled: true}
  x509: {clientCAFile: $cp_state/pki/ca.crt}
authorization:
  mode: Webhook
# The disk this runs on is shared and at times nearly full: never evict pods for disk space,
# nor collect images (the imported sandbox image cannot be pulled again). "0%" turns a signal
# off.
evictionHard:
  memory.available: 100Mi
  nodefs.available: "0%"
  nodefs.inodesFree: "0%"
  imagefs.available: "0%"
  imagefs.inodesFree: "0%"
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
EOF
# The kubelet wants its cgroup root to exist, in every hierarchy (cgroup v1) or the one tree.
for h in /sys/fs/cgroup/*/ /sys/fs/cgroup/; do
  [ -e "$h/cgroup.procs" ] && mkdir -p "$h/$node"
done
launch kubelet "$bin/kubelet" \
  --config="$state/kubelet.yaml" \
  --kubeconfig="$kubeconfig" \
  --root-dir="$state/kubelet" \
  --hostname-override="$node" \
  --node-ip="$gateway" \
  --cert-dir="$state/kubelet/pki"
node_ready() {
  [ "$("${kubectl[@]}" get node "$node" -o 'jsonpath={.status.conditions[?(@.type=="Ready")].status}')" = True ]
}
wait_until kubelet "node $node Ready" node_ready

# ---- kube-scheduler --------------------------------------------------------------------
pick_port
sched_port=$REPLY
launch kube-scheduler "$bin/kube-scheduler" \
  --kubeconfig="$kubeconfig" \
  --authentication-kubeconfig="$kubeconfig" \
  --authorization-kubeconfig="$kubeconfig" \
  --bind-address=127.0.0.1 \
  --secure-port="$sched_port" \
  --leader-elect=false
sched_healthy() {
  curl -sfk "https://127.0.0.1:$sched_port/healthz" | grep -qx ok
}
wait_until kube-scheduler "kube-scheduler /healthz" sched_healthy

cat >>"$state/env" <<EOF
LEASEHOLD_NODE_POD_GATEWAY=$gateway
LEASEHOLD_NODE_SANDBOX_IMAGE=$sandbox
LEASEHOLD_NODE_LOGS=$(printf %q "$state/pod-logs")
CONTAINERD_PID=$(cat "$state/containerd.pid")
KUBELET_PID=$(cat "$state/kubelet.pid")
KUBE_SCHEDULER_PID=$(cat "$state/kube-scheduler.pid")
REGISTRY_PID=$(cat "$state/registry.pid")
EOF
finished=1
echo "node $node ready in ${SECONDS}s: kubelet $gateway:$kubelet_port, containerd $state/containerd.sock," \
  "pods on $bridge $subnet, kube-scheduler 127.0.0.1:$sched_port, registry http://$registry"
