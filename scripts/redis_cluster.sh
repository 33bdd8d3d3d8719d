#!/usr/bin/env bash
# A throw-away Redis Cluster on loopback, for the shared prefix tier (pagedkv.tiers) and its tests.
#
# Usage:
#   scripts/redis_cluster.sh start [N]   start N (default 3) masters and create the cluster
#   scripts/redis_cluster.sh stop        stop them (by the pids they wrote) and delete their data
#
# Environment:
#   REDIS_CLUSTER_DIR   state directory (default: ${TMPDIR:-/tmp}/pagedkv-redis-cluster); one
#                       subdirectory per node holds its redis.conf, pid file, log and nodes.conf
#   REDIS_CLUSTER_PORT  first client port (default 30001); node i listens on PORT + i and on
#                       PORT + i + 10000 for the cluster bus
#
# Nodes keep nothing on disk (no RDB, no AOF): restarting one (redis-server DIR/PORT/redis.conf)
# brings it back empty into the same cluster. cluster-require-full-coverage is off, so the other
# nodes keep serving their slots while one is down, as a cache wants. start prints the URL that
# --tier and RedisTier take, redis+cluster://HOST:PORT,HOST:PORT,... (the node addresses are
# also in DIR/nodes, comma-separated).
set -euo pipefail

DIR=${REDIS_CLUSTER_DIR:-${TMPDIR:-/tmp}/pagedkv-redis-cluster}
BASE=${REDIS_CLUSTER_PORT:-30001}
die() { echo "redis_cluster.sh: $*" >&2; exit 1; }

start() {
    local n=${1:-3} i port nodes=() addresses
    [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 3 ] || die "Invalid value of N: expected an integer >= 3 (Redis Cluster needs 3 masters), got '$n'"
    command -v redis-server >/dev/null || die "redis-server not found (Debian/Ubuntu: apt-get install redis-server)"
    command -v redis-cli >/dev/null || die "redis-cli not found (it comes with redis-server, or redis-tools)"
    [ ! -e "$DIR" ] || die "$DIR exists: a cluster may be running; run '$0 stop' first"
    mkdir -p "$DIR"
    for ((i = 0; i < n; i++)); do
        port=$((BASE + i))
        mkdir -p "$DIR/$port"
        cat > "$DIR/$port/redis.conf" <<EOF
bind 127.0.0.1
port $port
dir $DIR/$port
pidfile $DIR/$port/redis.pid
logfile $DIR/$port/redis.log
daemonize yes
save ""
appendonly no
cluster-enabled yes
cluster-config-file nodes.conf
cluster-node-timeout 2000
cluster-require-full-coverage no
enable-debug-command local
EOF
        redis-server "$DIR/$port/redis.conf" || die "redis-server on port $port did not start (see $DIR/$port/redis.log)"
        nodes+=("127.0.0.1:$port")
    done
    for node in "${nodes[@]}"; do
        port=${node##*:}
        for ((i = 0; i < 100; i++)); do
            redis-cli -p "$port" ping >/dev/null 2>&1 && break
            sleep 0.05
        done
        redis-cli -p "$port" ping >/dev/null 2>&1 || die "node $node does not answer PING (see $DIR/$port/redis.log)"
    done
    redis-cli --cluster create "${nodes[@]}" --cluster-replicas 0 --cluster-yes >"$DIR/create.log" 2>&1 \
        || { cat "$DIR/create.log" >&2; die "redis-cli --cluster create failed"; }
    for node in "${nodes[@]}"; do
        port=${node##*:}
        for ((i = 0; i < 200; i++)); do
            redis-cli -p "$port" cluster info 2>/dev/null | grep -q "^cluster_state:ok" && break
            sleep 0.05
        done
        redis-cli -p "$port" cluster info | grep -q "^cluster_state:ok" || die "node $node: cluster_state is not ok after 10 s"
    done
    addresses=$(IFS=,; echo "${nodes[*]}")
    echo "$addresses" > "$DIR/nodes"
    echo "redis+cluster://$addresses"
}

stop() {
    local pidfile pid i
    [ -d "$DIR" ] || { echo "redis_cluster.sh: no cluster state in $DIR" >&2; return 0; }
    for pidfile in "$DIR"/*/redis.pid; do
        [ -f "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        kill -TERM "$pid" 2>/dev/null || continue
        for ((i = 0; i < 100; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.05
        done
        if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
    done
    rm -rf "$DIR"
}

case "${1:-}" in
    start) start "${2:-3}" ;;
    stop) stop ;;
    *) die "usage: $0 start [N] | stop" ;;
esac
