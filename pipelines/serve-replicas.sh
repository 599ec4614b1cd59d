#!/usr/bin/env bash
# The query service as REPLICAS copies of pipelines/serve.sh behind moe-broker, on this machine.
#
#   pipelines/serve-replicas.sh [INDEX]
#
# Clients see one service, as with serve.sh: they PUSH requests to QUERY_ENDPOINT
# (tcp://127.0.0.1:5555) and SUBscribe to RESULT_ENDPOINT (tcp://127.0.0.1:5556), both bound by
# the broker. The broker also binds REPLICA_QUERY_ENDPOINT (tcp://127.0.0.1:5557) and
# REPLICA_RESULT_ENDPOINT (tcp://127.0.0.1:5558), which REPLICAS (default 3) serve.sh processes
# connect to (QUERY_BIND=false RESULT_BIND=false); it deals the requests round-robin to the
# replicas connected at the time and merges their result streams (docs/replicas.md).
# A replica that exits is not restarted: the others go on serving, and the requests it held are
# lost; clients re-send what is not answered, by id (examples/client.py --retries). Restarting is
# a supervisor's job (systemd Restart=, Kubernetes: deploy/k8s/). This script exits when the
# broker does, or when no replica is left.
# CURVE_KEY / CURVE_ALLOWED put the client endpoints under CURVE (on the broker); the replicas
# reach the broker in plain ZeroMQ, so keep the REPLICA_* endpoints on loopback.
# METRICS_ADDRESS=HOST:PORT serves replica i's metrics (i = 1..REPLICAS) at HOST:PORT+i-1.
# Every other variable of serve.sh (MODEL, ADAPTER, DEVICE, PRECISION, IMAGE_ROOT, ...) reaches
# each replica. MOE_BROKER names the broker (default: build/tools/moe-broker in a source tree
# where it is built, else moe-broker on PATH).
# SIGINT or SIGTERM stops the replicas first (SIGINT: each finishes and publishes what it holds,
# for up to STOP_TIMEOUT seconds, default 10), then the broker; the script then exits 0.
set -euo pipefail
if ((BASH_VERSINFO[0] * 100 + BASH_VERSINFO[1] < 501)); then
  echo "serve-replicas: needs bash 5.1 or later (wait -n -p); this is $BASH_VERSION" >&2
  exit 2
fi
here=$(dirname "$0")
. "$here/env.sh"
INDEX=${1:-$INDEX}
REPLICAS=${REPLICAS:-3}
QUERY_ENDPOINT=${QUERY_ENDPOINT:-tcp://127.0.0.1:5555}
RESULT_ENDPOINT=${RESULT_ENDPOINT:-tcp://127.0.0.1:5556}
REPLICA_QUERY_ENDPOINT=${REPLICA_QUERY_ENDPOINT:-tcp://127.0.0.1:5557}
REPLICA_RESULT_ENDPOINT=${REPLICA_RESULT_ENDPOINT:-tcp://127.0.0.1:5558}
CURVE_KEY=${CURVE_KEY:-}
CURVE_ALLOWED=${CURVE_ALLOWED:-}
METRICS_ADDRESS=${METRICS_ADDRESS:-}
STOP_TIMEOUT=${STOP_TIMEOUT:-10}
say() { echo "serve-replicas: $*" >&2; }

if ! [[ $REPLICAS =~ ^[1-9][0-9]{0,2}$ ]]; then
  say "REPLICAS must be a whole number from 1 to 999 (got '$REPLICAS')"
  exit 2
fi
if [ -n "$METRICS_ADDRESS" ]; then
  if ! [[ $METRICS_ADDRESS =~ ^(.+):([0-9]+)$ ]]; then
    say "METRICS_ADDRESS must be HOST:PORT (got '$METRICS_ADDRESS')"
    exit 2
  fi
  metrics_host=${BASH_REMATCH[1]} metrics_port=${BASH_REMATCH[2]}
fi
if [ -z "${MOE_BROKER:-}" ]; then
  if [ -x "$repo/build/tools/moe-broker" ]; then
    MOE_BROKER=$repo/build/tools/moe-broker
  elif ! MOE_BROKER=$(command -v moe-broker); then
    say "moe-broker not found: build it (meson compile -C build) or name it with MOE_BROKER=PATH"
    exit 2
  fi
elif ! [ -x "$MOE_BROKER" ]; then
  say "MOE_BROKER=$MOE_BROKER is not an executable file"
  exit 2
fi

# Job control: each process in a process group of its own, so that a Ctrl-C at the terminal
# reaches this script alone, which stops the replicas before the broker (the broker carries their
# last results).
set -m
broker_args=(--requests "$QUERY_ENDPOINT" --results "$RESULT_ENDPOINT"
  --replica-requests "$REPLICA_QUERY_ENDPOINT" --replica-results "$REPLICA_RESULT_ENDPOINT")
if [ -n "$CURVE_KEY" ]; then broker_args+=(--curve-secret-key-file "$CURVE_KEY"); fi
if [ -n "$CURVE_ALLOWED" ]; then broker_args+=(--curve-allowed-keys "$CURVE_ALLOWED"); fi
"$MOE_BROKER" "${broker_args[@]}" &
broker=$!
say "moe-broker: pid $broker"

declare -A replica=() # pid -> replica number
for ((i = 1; i <= REPLICAS; i++)); do
  metrics=
  if [ -n "$METRICS_ADDRESS" ]; then metrics=$metrics_host:$((metrics_port + i - 1)); fi
  QUERY_ENDPOINT=$REPLICA_QUERY_ENDPOINT QUERY_BIND=false RESULT_ENDPOINT=$REPLICA_RESULT_ENDPOINT RESULT_BIND=false \
    CURVE_KEY='' CURVE_ALLOWED='' METRICS_ADDRESS=$metrics "$here/serve.sh" "$INDEX" &
  replica[$!]=$i
  say "replica $i: pid $!${metrics:+, metrics at http://$metrics/metrics}"
done

# Waits until the given processes have exited, at most STOP_TIMEOUT seconds, then kills the rest.
stop_within_timeout() {
  local deadline=$((SECONDS + STOP_TIMEOUT)) pid
  for pid in "$@"; do
    while kill -0 "$pid" 2>/dev/null && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      say "pid $pid did not stop within ${STOP_TIMEOUT}s: killing it"
      kill -KILL "$pid" 2>/dev/null || true
    fi
    wait "$pid" 2>/dev/null || true
  done
}

stop_all() {
  trap '' INT TERM # bounded by STOP_TIMEOUT: a second signal does not cut it short
  local pid
  for pid in "${!replica[@]}"; do kill -INT "$pid" 2>/dev/null || true; done
  stop_within_timeout "${!replica[@]}"
  if [ -n "$broker" ]; then
    kill -TERM "$broker" 2>/dev/null || true
    stop_within_timeout "$broker"
  fi
}
trap 'say "SIGINT: stopping"; stop_all; exit 0' INT
trap 'say "SIGTERM: stopping"; stop_all; exit 0' TERM

while :; do
  ended=
  status=0
  wait -n -p ended "$broker" "${!replica[@]}" || status=$?
  if [ -z "$ended" ]; then continue; fi # interrupted by a signal whose trap returned
  if [ "$ended" = "$broker" ]; then
    say "moe-broker exited with status $status: stopping the replicas"
    broker=
    stop_all
    exit $((status == 0 ? 1 : status))
  fi
  n=${replica[$ended]}
  unset "replica[$ended]"
  say "replica $n (pid $ended) exited with status $status; ${#replica[@]} of $REPLICAS left (not restarted)"
  if [ "${#replica[@]}" -eq 0 ]; then
    say "no replica left: stopping the broker"
    stop_all
    exit 1
  fi
done
