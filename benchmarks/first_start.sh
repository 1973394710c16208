#!/bin/bash
# A new user's first start, from a fresh clone and venv (run it from there), with empty
# caches: a server stopped with SIGTERM 2 s into its start, one killed 3 s in, then one
# started and sent a 32-token completion every 2 s from its first second.
#   bash benchmarks/first_start.sh [ITERATIONS] [PORT]
set -u
N=${1:-40}; PORT=${2:-8200}
CACHE=$(mktemp -d /tmp/nodraft-first-start-XXXX)
export TORCHINDUCTOR_CACHE_DIR=$CACHE/inductor TORCH_EXTENSIONS_DIR=$CACHE/extensions XDG_CACHE_HOME=$CACHE/xdg
nodraft serve --port "$PORT" > "$CACHE/stopped.log" 2>&1 & P=$!; sleep 2; kill -TERM $P; wait $P
echo "stopped 2 s into its start (SIGTERM): exit $?"
nodraft serve --port "$PORT" > "$CACHE/killed.log" 2>&1 & P=$!; sleep 3; kill -KILL $P; wait $P 2>/dev/null; sleep 1
echo "engine processes left after a SIGKILL 3 s into the start: $(pgrep -fc spawn_main || true)"
T0=$(date +%s.%N)
nodraft serve --port "$PORT" > "$CACHE/serve.log" 2>&1 & P=$!
for _ in $(seq 1 "$N"); do
  now=$(date +%s.%N)
  h=$(curl -s -m 1 "localhost:$PORT/health")
  r=$(curl -s -m 60 -o /dev/null -w "%{http_code} %{time_total}" "localhost:$PORT/v1/completions" \
      -H 'content-type: application/json' \
      -d '{"model":"micro","prompt":"def add(a, b):\n","max_tokens":32,"temperature":0}')
  printf "t=%5.1f s  health=%s  completion: %s s\n" "$(echo "$now - $T0" | bc)" "${h:-none}" "$r"
  sleep 2
done
kill -TERM $P; wait $P; echo "server exit $?; logs in $CACHE"
