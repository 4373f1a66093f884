#!/usr/bin/env bash
# Start a multi-node Ray cluster on this machine: a head and N worker nodes, each a separate
# `ray start` (its own raylet, object store, temp dir, ports) with its own shard cache
# (WORKFLOWS_CACHE_DIR) and object-spilling directory, so the per-node cache and rendezvous
# placement of shard reads behave as on a real cluster. Stop it with cluster/local/stop.sh.
#
#   cluster/local/start.sh [NUM_WORKERS]        # default 2 workers
#   source .workflows/local-cluster/env          # RAY_ADDRESS for drivers and `ray status`
#   python -m workflows pipeline --set ray.address=auto
#   cluster/local/stop.sh
#
# Settings (environment):
#   NUM_WORKERS=2          worker nodes (or the first argument)
#   CPUS_PER_NODE=1        --num-cpus of every worker node
#   HEAD_CPUS=1            --num-cpus of the head (0 keeps tasks off the head)
#   OBJECT_STORE_MB=512    object store of each node
#   RAY_PORT=6379          GCS port of the head; DASHBOARD_PORT=8265, CLIENT_PORT=10001
#   BASE_PORT=31000        node i uses BASE_PORT+10*i .. +5 (node manager, object manager,
#                          metrics, dashboard agent http/grpc, runtime-env agent)
#   STATE_DIR=.workflows/local-cluster   per-node cache/ and spill/ dirs, logs, pids, env file
#                          (give stop.sh the same STATE_DIR)
#   TMP_ROOT=/tmp/workflows-ray-$RAY_PORT   per-node Ray temp dirs (short: Unix socket paths)
#   RAY_AUTH_MODE=token    token authentication (Ray's default token file ~/.ray/auth_token is
#                          generated if missing); RAY_AUTH_MODE=disabled turns it off
#   RAY=ray                the `ray` executable (default: .venv/bin/ray if present)
#   START_TIMEOUT_S=180    how long to wait for the head, then for the worker nodes, to come up
#                          (more on a machine whose cores are busy with other work)
set -euo pipefail

die() { echo "start.sh: $*" >&2; exit 1; }
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
NUM_WORKERS=${1:-${NUM_WORKERS:-2}}
CPUS_PER_NODE=${CPUS_PER_NODE:-1}
HEAD_CPUS=${HEAD_CPUS:-$CPUS_PER_NODE}
OBJECT_STORE_MB=${OBJECT_STORE_MB:-512}
RAY_PORT=${RAY_PORT:-6379}
DASHBOARD_PORT=${DASHBOARD_PORT:-8265}
CLIENT_PORT=${CLIENT_PORT:-10001}
BASE_PORT=${BASE_PORT:-31000}
START_TIMEOUT_S=${START_TIMEOUT_S:-180}
STATE_DIR=${STATE_DIR:-$ROOT/.workflows/local-cluster}
TMP_ROOT=${TMP_ROOT:-/tmp/workflows-ray-$RAY_PORT}
if [ -z "${RAY:-}" ]; then
  if [ -x "$ROOT/.venv/bin/ray" ]; then RAY=$ROOT/.venv/bin/ray; else RAY=ray; fi
fi
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-token}
# Job entrypoints (`ray job submit -- python -m workflows ...`) run with the nodes' PATH: put the
# environment that holds `ray` (the project venv) first, so `python` there is that environment's.
RAY=$(command -v "$RAY" || true)
[ -n "$RAY" ] || die "ray not found: run 'make install' or set RAY=/path/to/ray"
export PATH="$(dirname "$RAY"):$PATH"

[[ "$NUM_WORKERS" =~ ^[0-9]+$ ]] || die "NUM_WORKERS must be a number, got '$NUM_WORKERS'"
port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

STATE_DIR=$(mkdir -p "$STATE_DIR" && cd "$STATE_DIR" && pwd)
PIDS=$STATE_DIR/pids
if [ -s "$PIDS" ]; then
  while read -r _ pid; do
    kill -0 "$pid" 2>/dev/null && die "a cluster started from $STATE_DIR is running (pid $pid): run cluster/local/stop.sh first"
  done <"$PIDS"
fi
for p in "$RAY_PORT" "$DASHBOARD_PORT" "$CLIENT_PORT"; do
  port_busy "$p" && die "port $p is in use (another Ray cluster?): set RAY_PORT / DASHBOARD_PORT / CLIENT_PORT"
done
: >"$PIDS"
echo "$TMP_ROOT" >"$STATE_DIR/tmp_root"

if [ "$RAY_AUTH_MODE" = token ] && [ -z "${RAY_AUTH_TOKEN:-}" ] && [ -z "${RAY_AUTH_TOKEN_PATH:-}" ] \
   && [ ! -s "$HOME/.ray/auth_token" ]; then
  "$RAY" get-auth-token --generate >/dev/null  # writes ~/.ray/auth_token; never printed here
fi

# start_node INDEX NAME ARGS...: one `ray start --block` in its own session (process group), so
# stop.sh can end exactly this node: SIGTERM to its pid makes it stop the processes it started.
start_node() {
  local i=$1 name=$2; shift 2
  local dir=$STATE_DIR/$name p=$((BASE_PORT + 10 * i))
  mkdir -p "$dir/cache" "$dir/spill" "$TMP_ROOT/$i"
  local launcher=()
  command -v setsid >/dev/null && launcher=(setsid)
  WORKFLOWS_CACHE_DIR=$dir/cache RAY_TRAIN_V2_ENABLED=1 nohup "${launcher[@]}" "$RAY" start --block \
    --num-cpus="$([ "$i" = 0 ] && echo "$HEAD_CPUS" || echo "$CPUS_PER_NODE")" \
    --object-store-memory=$((OBJECT_STORE_MB * 1024 * 1024)) \
    --temp-dir="$TMP_ROOT/$i" \
    --object-spilling-directory="$dir/spill" \
    --node-manager-port=$p --object-manager-port=$((p + 1)) --metrics-export-port=$((p + 2)) \
    --dashboard-agent-listen-port=$((p + 3)) --dashboard-agent-grpc-port=$((p + 4)) \
    --runtime-env-agent-port=$((p + 5)) --min-worker-port=0 --max-worker-port=0 \
    --disable-usage-stats "$@" >"$dir/ray-start.log" 2>&1 </dev/null &
  echo "$name $!" >>"$PIDS"
}

# ray_status: `ray status` of this cluster (exit 0 once the GCS answers)
ray_status() { "$RAY" status --address "127.0.0.1:$RAY_PORT" 2>/dev/null; }
wait_for() {  # wait_for SECONDS WHAT CHECK...
  local deadline=$((SECONDS + $1)) what=$2; shift 2
  until "$@"; do
    if [ $SECONDS -ge $deadline ]; then
      echo "start.sh: timed out waiting for $what; logs: $STATE_DIR/*/ray-start.log" >&2
      "$ROOT/cluster/local/stop.sh" >&2 || true
      exit 1
    fi
    sleep 2
  done
}
alive_nodes() { ray_status | grep -cE '^ +[0-9]+ node_' || true; }
all_nodes_up() { [ "$(alive_nodes)" -ge $((NUM_WORKERS + 1)) ]; }

unset RAY_ADDRESS
# Ray's state API (Train V2's placement-group cleaner) auto-detects the dashboard, which fails
# when this machine runs more than one cluster; the nodes' workers inherit the explicit address.
export RAY_API_SERVER_ADDRESS=http://127.0.0.1:$DASHBOARD_PORT
echo "starting the head on 127.0.0.1:$RAY_PORT (dashboard http://127.0.0.1:$DASHBOARD_PORT)"
start_node 0 head --head --node-ip-address=127.0.0.1 --port="$RAY_PORT" \
  --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" --ray-client-server-port="$CLIENT_PORT"
wait_for "$START_TIMEOUT_S" "the head" ray_status >/dev/null

for i in $(seq 1 "$NUM_WORKERS"); do
  echo "starting worker node $i"
  start_node "$i" "worker-$i" --address="127.0.0.1:$RAY_PORT" --node-ip-address=127.0.0.1
done
wait_for "$START_TIMEOUT_S" "$NUM_WORKERS worker node(s)" all_nodes_up

cat >"$STATE_DIR/env" <<EOF
# source this file: drivers with ray.address=auto and the ray CLI find the local cluster
export RAY_ADDRESS=127.0.0.1:$RAY_PORT
export RAY_API_SERVER_ADDRESS=http://127.0.0.1:$DASHBOARD_PORT
export RAY_AUTH_MODE=$RAY_AUTH_MODE
EOF
echo "local Ray cluster up: head + $NUM_WORKERS worker node(s), $(alive_nodes) alive"
echo "  per-node shard caches: $STATE_DIR/{head,worker-N}/cache"
echo "  drivers:  source $STATE_DIR/env && python -m workflows pipeline --set ray.address=auto"
echo "  jobs:     source $STATE_DIR/env && ray job submit --runtime-env cluster/runtime-env.yaml -- python -m workflows ..."
echo "  dashboard: http://127.0.0.1:$DASHBOARD_PORT"
if [ "$STATE_DIR" = "$ROOT/.workflows/local-cluster" ]; then
  echo "  stop:     cluster/local/stop.sh"
else
  echo "  stop:     STATE_DIR=$STATE_DIR cluster/local/stop.sh"
fi
