#!/usr/bin/env bash
# Builds helm from the Go module proxy, once per machine, cached outside the clone
# (tests/tools/go-command.sh). Prints the bin directory on its last line of stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=tests/tools/go-command.sh
. "$here/../go-command.sh"
go_command helm "$here" helm.sh/helm/v4 helm.sh/helm/v4/cmd/helm \
  helm.sh/helm/v4/internal/version.version
echo "$GO_COMMAND_BIN"
