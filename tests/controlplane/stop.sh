#!/usr/bin/env bash
# Stops the control plane that start.sh started in STATE_DIR: kube-controller-manager,
# kube-apiserver, then etcd (or only the named COMPONENTs), each with SIGTERM, up to
# 15 s to exit, then SIGKILL. Idempotent: missing or stale pid files are not an error.
# Data and logs stay in STATE_DIR.
#
# Usage: stop.sh STATE_DIR [COMPONENT...]
#
# Environment: LEASEHOLD_STOP_SIGNAL (first signal to send, default TERM; KILL makes
# it a crash).
set -euo pipefail

if [ $# -lt 1 ] || [ -z "$1" ]; then
  echo "usage: $0 STATE_DIR [COMPONENT...]" >&2
  exit 2
fi
state=$1
shift
[ -d "$state" ] || exit 0
signal=${LEASEHOLD_STOP_SIGNAL:-TERM}
if [ $# -eq 0 ]; then
  set -- kube-controller-manager kube-apiserver etcd
fi

# is_ours PID NAME: true if PID is a live process running bin/NAME, so that a
# recycled pid is never signalled.
is_ours() {
  local argv0
  kill -0 "$1" 2>/dev/null || return 1
  if [ -r "/proc/$1/cmdline" ]; then
    argv0=$(tr '\0' '\n' <"/proc/$1/cmdline" | head -n 1)
  else
    argv0=$(ps -p "$1" -o command= | awk '{ print $1 }')
  fi
  [ "$(basename -- "${argv0:-none}")" = "$2" ]
}

# started PID: prints when PID started (empty if there is no such process).
started() {
  if [ -r "/proc/$1/stat" ]; then
    { sed 's/.*) //' "/proc/$1/stat" 2>/dev/null || true; } | awk '{ print $20 }'
  else
    ps -p "$1" -o lstart= 2>/dev/null || true
  fi
}

# exited PID START: true once the process PID that started at START has exited and
# closed its files (it is gone, a zombie, or PID now names another process).
exited() {
  local st
  [ "$(started "$1")" = "$2" ] || return 0
  if [ -r "/proc/$1/stat" ]; then
    st=$({ sed 's/.*) //' "/proc/$1/stat" 2>/dev/null || true; } | awk '{ print $1 }')
  else
    st=$(ps -p "$1" -o stat= 2>/dev/null || true)
  fi
  case $st in "" | Z* | X*) return 0 ;; *) return 1 ;; esac
}

# wait_exited PID START TENTHS: waits up to TENTHS/10 s for the process to exit.
wait_exited() {
  local i
  for ((i = 0; i < $3; i++)); do
    exited "$1" "$2" && return 0
    sleep 0.1
  done
  exited "$1" "$2"
}

for name in "$@"; do
  pidfile=$state/$name.pid
  [ -f "$pidfile" ] || continue
  pid=$(cat "$pidfile")
  if [ -n "$pid" ] && is_ours "$pid" "$name"; then
    start=$(started "$pid")
    kill -s "$signal" "$pid" 2>/dev/null || true
    if ! wait_exited "$pid" "$start" 150; then
      echo "stop.sh: $name (pid $pid) still running after 15s, sending SIGKILL" >&2
      kill -s KILL "$pid" 2>/dev/null || true
      wait_exited "$pid" "$start" 100 || { echo "stop.sh: $name (pid $pid) would not exit" >&2; exit 1; }
    fi
  fi
  rm -f "$pidfile"
done
