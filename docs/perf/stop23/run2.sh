#!/bin/bash
cd /work/main
B=/work/bench6
while ! grep -q ALLDONE $B/times.log; do sleep 5; done
echo "== llm_bf16_b1_confirm start $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)" >> $B/times.log
.venv/bin/python benchmarks/llm.py --batches 1 --dtypes bfloat16 --new 256 --repeats 5 --threads 2 --out $B/llm_bf16_b1_confirm > $B/llm_bf16_b1_confirm.log 2>&1
echo "== llm_bf16_b1_confirm end $(date -u +%T) rc=$?" >> $B/times.log
echo ALLDONE2 >> $B/times.log
