#!/usr/bin/env bash
# Builds the OCI registry the node tests install leasehold from (distribution's
# cmd/registry, `registry serve CONFIG`) from the Go module proxy, once per machine, cached
# outside the clone (tests/tools/go-command.sh). Prints the binary's path on its last line
# of stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/tools/go-command.sh
. "$here/../go-command.sh"
module=github.com/distribution/distribution/v3
go_command registry "$here" "$module" "$module/cmd/registry" "$module/version.version"
echo "$GO_COMMAND_BIN/registry"
