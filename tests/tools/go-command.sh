# shellcheck shell=bash
# Sourced by the build scripts of the Go tools the tests use (tests/tools/helm/build.sh,
# tests/tools/registry/build.sh): one command of one module from the Go module proxy, built
# once per machine. Defines go_command; changes nothing else.

# go_command NAME DIR MODULE PACKAGE VERSION_VAR
# Builds PACKAGE, a command of MODULE at the version DIR's go.mod pins, into the cache outside
# the clone, as bin/NAME under a directory keyed by the hash of DIR's go.mod, go.sum and
# build.sh and of this file, with MODULE's version written into the Go variable VERSION_VAR.
# Sets GO_COMMAND_BIN to the bin directory. Progress goes to stderr.
go_command() {
  local name=$1 dir=$2 module=$3 package=$4 version_var=$5
  export GOTOOLCHAIN=${GOTOOLCHAIN:-auto}
  export GOFLAGS=-buildvcs=false
  local cache_root=${LEASEHOLD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/leasehold}
  local key
  key=$(cat "$dir/go.mod" "$dir/go.sum" "$dir/build.sh" "${BASH_SOURCE[0]}" | sha256sum | cut -c1-16)
  GO_COMMAND_BIN="$cache_root/$name-$key/bin"
  if [ -x "$GO_COMMAND_BIN/$name" ]; then
    return 0
  fi
  local version tmp="$GO_COMMAND_BIN.tmp.$$"
  version=$(cd "$dir" && go list -m -f "{{.Version}}" "$module")
  mkdir -p "$tmp"
  echo "building $name ($module $version) into $GO_COMMAND_BIN (first time on this machine:" \
    "a few minutes)" >&2
  if ! (cd "$dir" && go build -trimpath -ldflags "-s -w -X $version_var=$version" \
    -o "$tmp/$name" "$package" >&2); then
    rm -rf "$tmp"
    return 1
  fi
  rm -rf "$GO_COMMAND_BIN"
  mv "$tmp" "$GO_COMMAND_BIN"
}
