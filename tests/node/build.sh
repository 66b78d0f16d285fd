#!/usr/bin/env bash
# Builds the node the node tests run pods on, from the Go module proxy, once per machine:
# kubelet and kube-scheduler (this module: Kubernetes at the control plane's version),
# containerd, its runc shim and ctr (containerd v2.4.2; without the btrfs, devmapper and
# zfs snapshotters, which need C libraries), the CNI loopback, bridge and host-local
# plugins (containernetworking plugins v1.10.0) and the sandbox image's `pause` program (cmd/pause). The binaries are
# cached outside the clone under a directory keyed by the hash of this module's go.mod,
# go.sum, cmd/pause and this script (which names the containerd and CNI versions), apart
# from the control plane's key. Prints the bin directory on its last line of stdout.
# runc is not built here: Debian's (seccomp-enabled) runc is used, see start.sh.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export GOTOOLCHAIN=${GOTOOLCHAIN:-auto}
export GOFLAGS=-buildvcs=false
containerd_version=v2.4.2
cni_plugins_version=v1.10.0
cache_root=${LEASEHOLD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/leasehold}
key=$(cat "$here/go.mod" "$here/go.sum" "$here/cmd/pause/main.go" "$here/build.sh" | sha256sum | cut -c1-16)
bin="$cache_root/node-$key/bin"
all="kubelet kube-scheduler containerd containerd-shim-runc-v2 ctr loopback bridge host-local pause"
complete=1
for b in $all; do [ -x "$bin/$b" ] || complete=; done
if [ -n "$complete" ]; then
  echo "$bin"
  exit 0
fi
k8s_version=$(cd "$here" && go list -m -f "{{.Version}}" k8s.io/kubernetes)
minor=$(echo "$k8s_version" | cut -d. -f2)
ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  ldflags="$ldflags -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  ldflags="$ldflags -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
tmp="$bin.tmp.$$"
mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT
cd "$here"
echo "building the node (kubelet, kube-scheduler $k8s_version, containerd $containerd_version," \
  "CNI plugins $cni_plugins_version) into $bin (first time on this machine: several minutes)" >&2
go build -trimpath -ldflags "$ldflags" -o "$tmp/kubelet" k8s.io/kubernetes/cmd/kubelet >&2
go build -trimpath -ldflags "$ldflags" -o "$tmp/kube-scheduler" k8s.io/kubernetes/cmd/kube-scheduler >&2
CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o "$tmp/pause" ./cmd/pause >&2
# `go install pkg@version` builds in the module's own dependency graph (go.sum-verified),
# outside this module, so containerd's dependencies cannot clash with Kubernetes'.
cd_ldflags="-s -w -X github.com/containerd/containerd/v2/version.Version=$containerd_version"
GOBIN=$tmp go install -trimpath -tags "no_btrfs no_devmapper no_zfs" -ldflags "$cd_ldflags" \
  "github.com/containerd/containerd/v2/cmd/containerd@$containerd_version" \
  "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$containerd_version" \
  "github.com/containerd/containerd/v2/cmd/ctr@$containerd_version" >&2
GOBIN=$tmp CGO_ENABLED=0 go install -trimpath -ldflags "-s -w" \
  "github.com/containernetworking/plugins/plugins/main/loopback@$cni_plugins_version" \
  "github.com/containernetworking/plugins/plugins/main/bridge@$cni_plugins_version" \
  "github.com/containernetworking/plugins/plugins/ipam/host-local@$cni_plugins_version" >&2
rm -rf "$bin"
mv "$tmp" "$bin"
trap - EXIT
echo "$bin"
