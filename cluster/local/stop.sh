#!/usr/bin/env bash
# Stop the local multi-node Ray cluster started by cluster/local/start.sh: exactly the nodes it
# started (by the pids it recorded), workers first, then the head. Other Ray clusters on this
# machine are left alone (unlike `ray stop`, which stops every Ray process of the user).
#
#   cluster/local/stop.sh            # keeps the per-node shard caches
#   cluster/local/stop.sh --purge    # also deletes them (STATE_DIR) and the Ray temp dirs
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
STATE_DIR=${STATE_DIR:-$ROOT/.workflows/local-cluster}
PIDS=$STATE_DIR/pids
PURGE=0
[ "${1:-}" = "--purge" ] && PURGE=1

if [ ! -s "$PIDS" ]; then
  echo "stop.sh: no local cluster recorded in $STATE_DIR"
else
  # Workers first (reverse start order), then the head. SIGTERM makes `ray start --block` stop
  # the raylet, object store, agents (and on the head the GCS and dashboard) it started.
  tac "$PIDS" | while read -r name pid; do
    if kill -0 "$pid" 2>/dev/null; then
      echo "stopping $name (pid $pid)"
      kill -TERM "$pid" 2>/dev/null || true
      for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    fi
    # Anything left in the node's own process group (it was started with setsid): kill it.
    if kill -0 -- "-$pid" 2>/dev/null; then
      sleep 2
      kill -KILL -- "-$pid" 2>/dev/null || true
    fi
  done
  rm -f "$PIDS" "$STATE_DIR/env"
  echo "local Ray cluster stopped"
fi

if [ "$PURGE" = 1 ]; then
  if [ -s "$STATE_DIR/tmp_root" ]; then
    tmp_root=$(cat "$STATE_DIR/tmp_root")
    case "$tmp_root" in /tmp/workflows-ray-*) rm -rf "$tmp_root" ;; esac
  fi
  rm -rf "$STATE_DIR"
  echo "removed $STATE_DIR"
fi
