#!/usr/bin/env bash
# Installs the TypeScript client's dev dependencies (typescript and @types/node, pinned by
# clients/typescript/package-lock.json) from the npm registry with `npm ci`, once per machine,
# into a directory keyed by the hash of package.json, package-lock.json, this script and the
# Node version. Prints that node_modules directory on its last line of stdout. Needs Node >= 20
# and npm on PATH.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
package="$here/../../../clients/typescript"
cache_root=${LEASEHOLD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/leasehold}
for tool in node npm; do
  command -v "$tool" >/dev/null || { echo "the TypeScript client's tests need $tool (Node >= 20) on PATH" >&2; exit 1; }
done
major=$(node -p 'process.versions.node.split(".")[0]')
if [ "$major" -lt 20 ]; then
  echo "the TypeScript client needs Node >= 20; $(command -v node) is $(node --version)" >&2
  exit 1
fi
key=$( { cat "$package/package.json" "$package/package-lock.json" "$here/modules.sh"; node --version; } |
  sha256sum | cut -c1-16)
dir="$cache_root/node-modules-$key"
if [ ! -f "$dir/.complete" ]; then
  echo "installing the TypeScript client's dev dependencies into $dir (first time on this machine)" >&2
  rm -rf "$dir"
  mkdir -p "$dir"
  cp "$package/package.json" "$package/package-lock.json" "$dir/"
  (cd "$dir" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error) >&2
  touch "$dir/.complete"
fi
echo "$dir/node_modules"
