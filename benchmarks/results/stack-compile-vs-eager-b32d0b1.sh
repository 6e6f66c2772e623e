cd /work/main
source .venv/bin/activate
M=/tmp/smollm2-shape
tokenline serve --model $M --dtype bfloat16 --port 8420 > /tmp/eager-serve.log 2>&1 &
E=$!
tokenline serve --model $M --dtype bfloat16 --compile --port 8430 > /tmp/compile-serve.log 2>&1 &
C=$!
for u in 8420 8430; do for i in $(seq 400); do curl -sf http://127.0.0.1:$u/ready >/dev/null && break; sleep 1; done; done
echo ready $(date +%T)
EP=$(pgrep -f "port 8420" | paste -sd,)
CP=$(pgrep -f "port 8430" | paste -sd,)
snap() { for p in 8422 8432; do echo "== $p $1"; curl -s http://127.0.0.1:$p/metrics | grep -E '^tokenline_step_phase_seconds_(sum|count)\{phase="forward"'; done; }
snap before
for c in 1 16; do
 n=8; [ $c = 16 ] && n=48
 tokenline bench --url http://127.0.0.1:8420 --model $M --label eager \
  --compare http://127.0.0.1:8430 --compare-model $M --compare-label compile \
  --compare-ignore-eos --num-requests $n --output-len 64 --concurrency $c --rounds 2 \
  --seed 216 --temperature 0 --pids "$EP" --compare-pids "$CP" --no-progress > /tmp/ab-compile-c$c.txt 2>&1
 snap after-c$c
done
kill $E $C; wait
echo DONE $(date +%T)
