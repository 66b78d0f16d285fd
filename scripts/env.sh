# Sourced by the scripts in this folder: where builds are cached.
#
# Cargo's target directory lives outside the clone, keyed by the Rust toolchain, Cargo.lock
# and the clone's path, so a fresh clone at a path that built before starts warm. The path
# is part of the key because Cargo decides freshness by file times, not contents: two clones
# at different paths sharing one target directory would each take the other's newer build
# as their own (tests read the repository's files from the path compiled into them, and a
# tree edited before the other clone's build would run that build's code). Set
# CARGO_TARGET_DIR yourself to override. The control plane's binaries are cached by
# tests/controlplane/build.sh the same way.
leasehold_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
leasehold_cache=${LEASEHOLD_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/leasehold}
if [ -z "${CARGO_TARGET_DIR:-}" ]; then
  key=$( { rustc -V; cat "$leasehold_root/Cargo.lock"; echo "$leasehold_root"; } | sha256sum | cut -c1-16)
  export CARGO_TARGET_DIR="$leasehold_cache/target-$key"
fi
export LEASEHOLD_CACHE=$leasehold_cache
