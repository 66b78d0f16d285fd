#!/usr/bin/env bash
# Makes the venv the sidecar's API conformance test runs schemathesis from, once per machine:
# schemathesis from PyPI (requirements.txt), in a directory keyed by the hash of
# requirements.txt, this script and the Python version. Prints the venv's schemathesis
# command (`st`) on its last line of stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache_root=${LEASEHOLD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/leasehold}
key=$( { cat "$here/requirements.txt" "$here/venv.sh"; python3 -V; } | sha256sum | cut -c1-16)
venv="$cache_root/schemathesis-venv-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "making the schemathesis venv $venv (first time on this machine)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check --no-cache-dir -r "$here/requirements.txt" >&2
  touch "$venv/.complete"
fi
echo "$venv/bin/st"
