#!/usr/bin/env bash
# Run a command while a busy-loop process keeps one CPU core occupied: `make test-loaded` runs `make test`
# this way, so the suite is also checked on a loaded machine (no test may depend on how long anything takes).
#
#   bash scripts/with_busy_core.sh make test
#
# The loop is pinned to the last core with taskset when it is installed (else it runs unpinned), and it is
# stopped, by the PID this script started, when the command ends, fails or is interrupted.
set -u
core=$(( $(nproc) - 1 ))
if command -v taskset >/dev/null 2>&1; then
    taskset -c "$core" bash -c 'while :; do :; done' &
    where="pinned to core $core"
else
    bash -c 'while :; do :; done' &
    where="unpinned (no taskset)"
fi
busy=$!
trap 'kill "$busy" 2>/dev/null; wait "$busy" 2>/dev/null' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
echo "busy loop: pid $busy, $where" >&2
"$@"
