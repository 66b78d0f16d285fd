#!/usr/bin/env bash
# Builds prometheus and promtool from the Go module proxy, once per machine: the binaries
# are cached outside the clone, under a directory keyed by the hash of this module's go.mod,
# go.sum, this script and the Go version (its own key, apart from the control plane's and
# helm's). Prints the bin directory on its last line of stdout.
#
# Built with the tag remove_all_sd: of Prometheus's service discoveries only the static,
# file and HTTP ones stay (the tests scrape static targets), which leaves out the cloud SDKs
# and halves a cold build. Without the tag builtinassets the web UI is not embedded
# (building it needs npm); the HTTP API, which the tests use, is all there.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export GOTOOLCHAIN=${GOTOOLCHAIN:-auto}
export GOFLAGS=-buildvcs=false
cache_root=${LEASEHOLD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/leasehold}
cd "$here"
key=$( { cat go.mod go.sum build.sh; go env GOVERSION; } | sha256sum | cut -c1-16)
bin="$cache_root/prometheus-$key/bin"
if [ -x "$bin/prometheus" ] && [ -x "$bin/promtool" ]; then
  echo "$bin"
  exit 0
fi
module=github.com/prometheus/prometheus
# The module's v0.3XY.Z is Prometheus 3.XY.Z (its VERSION file). `go list -m` names the
# module's directory only once it is downloaded (not yet on a fresh machine).
go mod download "$module"
version=$(go list -m -f "{{.Version}}" "$module")
release=$(cat "$(go list -m -f "{{.Dir}}" "$module")/VERSION")
ldflags="-s -w"
ldflags="$ldflags -X github.com/prometheus/common/version.Version=$release"
ldflags="$ldflags -X github.com/prometheus/common/version.Revision=$version"
ldflags="$ldflags -X github.com/prometheus/common/version.Branch=module-proxy"
tmp="$bin.tmp.$$"
mkdir -p "$tmp"
trap 'rm -rf "$tmp"' EXIT
echo "building prometheus and promtool $release ($module $version) into $bin (first time on this machine: several minutes)" >&2
go build -trimpath -tags netgo,remove_all_sd -ldflags "$ldflags" -o "$tmp/prometheus" "$module/cmd/prometheus" >&2
go build -trimpath -tags netgo,remove_all_sd -ldflags "$ldflags" -o "$tmp/promtool" "$module/cmd/promtool" >&2
rm -rf "$bin"
mv "$tmp" "$bin"
trap - EXIT
echo "$bin"
