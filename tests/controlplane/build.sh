#!/usr/bin/env bash
# Builds the local control plane (kube-apiserver, kube-controller-manager, kubectl,
# etcd) from the Go module proxy, once per machine: the binaries are cached outside
# the clone, under a directory keyed by the hash of this module's go.mod, go.sum and
# this script. Prints the bin directory on its last line of stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# Kubernetes 1.37 needs go >= 1.26.0, which this machine has; a newer toolchain
# would come from the module proxy if go.mod ever asked for it.
export GOTOOLCHAIN=${GOTOOLCHAIN:-auto}
export GOFLAGS=-buildvcs=false
cache_root=${LEASEHOLD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/leasehold}
key=$(cat "$here/go.mod" "$here/go.sum" "$here/build.sh" | sha256sum | cut -c1-16)
bin="$cache_root/controlplane-$key/bin"
if [ -x "$bin/kube-apiserver" ] && [ -x "$bin/kube-controller-manager" ] \
  && [ -x "$bin/kubectl" ] && [ -x "$bin/etcd" ]; then
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
cd "$here"
echo "building the Kubernetes $k8s_version control plane into $bin (first time on this machine: several minutes)" >&2
go build -trimpath -ldflags "$ldflags" -o "$tmp/kube-apiserver" k8s.io/kubernetes/cmd/kube-apiserver >&2
go build -trimpath -ldflags "$ldflags" -o "$tmp/kube-controller-manager" k8s.io/kubernetes/cmd/kube-controller-manager >&2
go build -trimpath -ldflags "$ldflags" -o "$tmp/kubectl" ./cmd/kubectl >&2
go build -trimpath -ldflags "-s -w" -o "$tmp/etcd" ./cmd/etcd >&2
rm -rf "$bin"
mv "$tmp" "$bin"
echo "$bin"
