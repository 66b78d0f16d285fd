# Sourced by the scripts in this folder: where builds are cached.
#
# Cargo's target directory lives outside the clone, keyed by the Rust toolchain and
# Cargo.lock, so a fresh clone on a machine that built before starts warm. Set
# CARGO_TARGET_DIR yourself to override. The control plane's binaries are cached by
# tests/controlplane/build.sh the same way.
leasehold_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
leasehold_cache=${LEASEHOLD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/leasehold}
if [ -z "${CARGO_TARGET_DIR:-}" ]; then
  key=$( { rustc -V; cat "$leasehold_root/Cargo.lock"; } | sha256sum | cut -c1-16)
  export CARGO_TARGET_DIR="$leasehold_cache/target-$key"
fi
export LEASEHOLD_CACHE=$leasehold_cache
