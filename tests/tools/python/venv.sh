#!/usr/bin/env bash
# Makes the venv the Python client's tests run in, once per machine: pytest and setuptools
# from PyPI (requirements.txt), in a directory keyed by the hash of requirements.txt, this
# script and the Python version. Prints the venv's python on its last line of stdout.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache_root=${LEASEHOLD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/leasehold}
key=$( { cat "$here/requirements.txt" "$here/venv.sh"; python3 -V; } | sha256sum | cut -c1-16)
venv="$cache_root/pytest-venv-$key"
if [ ! -f "$venv/.complete" ]; then
  echo "making the pytest venv $venv (first time on this machine)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --disable-pip-version-check -r "$here/requirements.txt" >&2
  touch "$venv/.complete"
fi
echo "$venv/bin/python"
