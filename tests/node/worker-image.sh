#!/usr/bin/env bash
# Builds the image the chart's example worker runs in on the test node, where python:3.12-slim
# (the chart's default) cannot be pulled: FROM scratch, with the host's Debian python3, the
# shared libraries it and its extension modules load, its standard library (without tests,
# IDLE, tkinter and site-packages), /usr/share/common-licenses (the example jobs' inputs) and
# an /etc/passwd naming uid 65532. Cached outside the clone keyed by this script and the
# python binary; a second run builds nothing.
#
# Usage: worker-image.sh
# Prints the image's name and the path of its docker-archive on its last two lines.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
export CONTAINERS_CONF=${CONTAINERS_CONF:-$here/../../scripts/containers.conf}
cache_root=${LEASEHOLD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/leasehold}
python=$(readlink -f /usr/bin/python3)
[ -x "$python" ] || { echo "worker-image.sh: no /usr/bin/python3 (apt-get install python3)" >&2; exit 1; }
ver=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
key=$(sha256sum "$here/worker-image.sh" "$python" | sha256sum | cut -c1-16)
name=localhost/leasehold-example-worker:$key
dir=$cache_root/worker-image-$key
archive=$dir/image.tar
if [ -s "$archive" ]; then
  echo "$name"
  echo "$archive"
  exit 0
fi
ctx=$(mktemp -d "${TMPDIR:-/tmp}/leasehold-worker-image.XXXXXX")
trap 'rm -rf "$ctx"' EXIT
root=$ctx/root
mkdir -p "$root/usr/bin" "$root/usr/lib" "$root/etc" "$root/tmp" "$root/usr/share"
cp "$python" "$root/usr/bin/python$ver"
ln -s "python$ver" "$root/usr/bin/python3"
tar -C /usr/lib -cf - --exclude="python$ver/test" --exclude="python$ver/idlelib" \
  --exclude="python$ver/tkinter" --exclude="python$ver/ensurepip" \
  --exclude="python$ver/lib2to3" --exclude="python$ver/site-packages" \
  --exclude="python$ver/dist-packages" "python$ver" | tar -C "$root/usr/lib" -xf -
cp -r /usr/share/common-licenses "$root/usr/share/"
# Every shared library the interpreter and its extension modules need, at the same paths.
{
  ldd "$python"
  find "/usr/lib/python$ver/lib-dynload" -name '*.so' -exec ldd {} \;
} | awk '/=>/ { print $3 } /^\t\// { print $1 }' | grep '^/' | sort -u | while read -r lib; do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
printf 'root:x:0:0:root:/root:/sbin/nologin\nworker:x:65532:65532:worker:/tmp:/sbin/nologin\n' >"$root/etc/passwd"
printf 'root:x:0:\nworker:x:65532:\n' >"$root/etc/group"
chmod 1777 "$root/tmp"
printf 'FROM scratch\nCOPY root/ /\nENV PYTHONDONTWRITEBYTECODE=1\nUSER 65532:65532\n' >"$ctx/Containerfile"
podman build -q --no-cache -t "$name" "$ctx" >&2
mkdir -p "$dir"
podman save -q --format docker-archive -o "$archive.tmp" "$name"
mv "$archive.tmp" "$archive"
echo "$name"
echo "$archive"
