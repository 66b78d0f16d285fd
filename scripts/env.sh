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
  # Each target directory is 5 to 20 GB, and a new one comes with every clone path, toolchain
  # or Cargo.lock: drop those whose clone is gone, those of this clone under an older key, and
  # unmarked ones (from before the mark) untouched for two days. Each names its clone in the
  # file .leasehold-root.
  mkdir -p "$CARGO_TARGET_DIR"
  printf '%s\n' "$leasehold_root" >"$CARGO_TARGET_DIR/.leasehold-root"
  for old in "$leasehold_cache"/target-*; do
    [ -d "$old" ] && [ "$old" != "$CARGO_TARGET_DIR" ] || continue
    if [ -f "$old/.leasehold-root" ]; then
      root=$(cat "$old/.leasehold-root")
      if [ -d "$root" ] && [ "$root" != "$leasehold_root" ]; then
        continue
      fi
    elif [ -n "$(find "$old" -maxdepth 0 -mtime -2)" ]; then
      continue
    fi
    rm -rf "$old"
  done
fi
export LEASEHOLD_CACHE=$leasehold_cache
