#!/usr/bin/env bash
# Builds the OCI registry the node tests install leasehold from (distribution's
# cmd/registry, `registry serve CONFIG`), from the Go module proxy, once per machine: the
# binary is cached outside the clone, under a directory keyed by the hash of this module's
# go.mod, go.sum and this script. Prints the binary's path on its last line of stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export GOTOOLCHAIN=${GOTOOLCHAIN:-auto}
export GOFLAGS=-buildvcs=false
cache_root=${LEASEHOLD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/leasehold}
key=$(cat "$here/go.mod" "$here/go.sum" "$here/build.sh" | sha256sum | cut -c1-16)
bin="$cache_root/registry-$key/bin"
if [ -x "$bin/registry" ]; then
  echo "$bin/registry"
  exit 0
fi
cd "$here"
module=github.com/distribution/distribution/v3
version=$(go list -m -f "{{.Version}}" "$module")
tmp="$bin.tmp.$$"
mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT
echo "building the registry (distribution $version) into $bin (first time on this machine:" \
  "a few minutes)" >&2
go build -trimpath -ldflags "-s -w -X $module/version.version=$version" \
  -o "$tmp/registry" "$module/cmd/registry" >&2
rm -rf "$bin"
mv "$tmp" "$bin"
echo "$bin/registry"
