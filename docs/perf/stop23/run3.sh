#!/bin/bash
cd /work/main
B=/work/bench6
while pgrep -f train_floor.py > /dev/null; do sleep 3; done
echo "== train_floor end $(date -u +%T) (parent script stopped; serve_llama skipped)" >> $B/times.log
echo "== llm_bf16_b8_ab start $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)" >> $B/times.log
.venv/bin/python benchmarks/llm.py --batches 8 --dtypes bfloat16 --new 32 --prefill 32 --repeats 3 --threads 2 --ab-tiles --out $B/llm_bf16_b8_ab > $B/llm_bf16_b8_ab.log 2>&1
echo "== llm_bf16_b8_ab end $(date -u +%T) rc=$?" >> $B/times.log
echo ALLDONE >> $B/times.log
