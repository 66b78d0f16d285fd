#!/usr/bin/env bash
# Builds helm from the Go module proxy, once per machine: the binary is cached outside
# the clone, under a directory keyed by the hash of this module's go.mod, go.sum and
# this script (its own key, apart from the control plane's). Prints the bin directory
# on its last line of stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export GOTOOLCHAIN=${GOTOOLCHAIN:-auto}
export GOFLAGS=-buildvcs=false
cache_root=${LEASEHOLD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/leasehold}
key=$(cat "$here/go.mod" "$here/go.sum" "$here/build.sh" | sha256sum | cut -c1-16)
bin="$cache_root/helm-$key/bin"
if [ -x "$bin/helm" ]; then
  echo "$bin"
  exit 0
fi
cd "$here"
version=$(go list -m -f "{{.Version}}" helm.sh/helm/v4)
tmp="$bin.tmp.$$"
mkdir -p "$tmp"
echo "building helm $version into $bin (first time on this machine: a few minutes)" >&2
go build -trimpath -ldflags "-s -w -X helm.sh/helm/v4/internal/version.version=$version" \
  -o "$tmp/helm" helm.sh/helm/v4/cmd/helm >&2
rm -rf "$bin"
mv "$tmp" "$bin"
echo "$bin"
