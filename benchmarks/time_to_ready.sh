#!/usr/bin/env bash
# Seconds from `tokenline serve --model tiny` to its first 200 on /ready, RUNS times.
# Usage: bash benchmarks/time_to_ready.sh [RUNS] [PORT]
set -euo pipefail
runs=${1:-3}
port=${2:-8610}
tokenline=${TOKENLINE:-.venv/bin/tokenline}
for _ in $(seq "$runs"); do
    start=$(date +%s.%N)
    "$tokenline" serve --model tiny --port "$port" > /dev/null 2>&1 &
    pid=$!
    until curl -sf "http://127.0.0.1:$port/ready" > /dev/null; do sleep 0.1; done
    echo "ready in $(echo "$(date +%s.%N) - $start" | bc) s"
    kill -TERM "$pid"
    wait "$pid" || true
done
