#!/usr/bin/env bash
# Restarts the kube-apiserver of the control plane in STATE_DIR: see restart.sh.
#
# Usage: restart-apiserver.sh STATE_DIR [SIGNAL]
set -euo pipefail
if [ $# -lt 1 ] || [ $# -gt 2 ] || [ -z "$1" ]; then
  echo "usage: $0 STATE_DIR [SIGNAL]" >&2
  exit 2
fi
exec "$(dirname "$0")/restart.sh" "$1" kube-apiserver "${2:-TERM}"
