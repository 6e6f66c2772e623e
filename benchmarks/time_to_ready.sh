#!/usr/bin/env bash
# Seconds from `tokenline serve --model tiny` to its first 200 on /ready.
# Usage: bash benchmarks/time_to_ready.sh [RUNS] [TREE...]
# Each TREE is a checkout whose services/ is put first on PYTHONPATH (default: this one);
# with several, each round runs them in turn, so they share the machine's hour.
set -euo pipefail
runs=${1:-3}
shift || true
trees=("$@")
[ ${#trees[@]} -gt 0 ] || trees=(.)
python=${PYTHON:-.venv/bin/python}
port=${PORT:-8610}
deadline_s=${DEADLINE_S:-120}
pid=
trap '[ -n "$pid" ] && kill -TERM "$pid" 2>/dev/null; true' EXIT
if curl -s -o /dev/null "http://127.0.0.1:$port/ready"; then
    echo "port $port already answers: stop what serves there, or set PORT" >&2
    exit 1
fi
for _ in $(seq "$runs"); do
    for tree in "${trees[@]}"; do
        start=$(date +%s.%N)
        PYTHONPATH="$(cd "$tree" && pwd)/services" "$python" -m tokenline.cli serve \
            --model tiny --port "$port" > /dev/null 2>&1 &
        pid=$!
        until curl -sf -o /dev/null "http://127.0.0.1:$port/ready"; do
            kill -0 "$pid" 2>/dev/null || { echo "$tree: serve exited before ready" >&2; exit 1; }
            if (($(echo "$(date +%s.%N) - $start > $deadline_s" | bc))); then
                echo "$tree: not ready in ${deadline_s}s" >&2
                exit 1
            fi
            sleep 0.1
        done
        echo "$tree ready in $(echo "$(date +%s.%N) - $start" | bc) s"
        kill -TERM "$pid"
        wait "$pid" || true
        pid=
    done
done
