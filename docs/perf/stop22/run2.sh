#!/bin/bash
cd /work/main
B=/work/bench5
while ! grep -q ALLDONE $B/times.log; do sleep 5; done
echo "== serve_llama_full start $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)" >> $B/times.log
.venv/bin/python benchmarks/serve.py --family llama --parts load --out $B/serve/serve_llama_full.json > $B/serve_llama_full.log 2>&1
echo "== serve_llama_full end $(date -u +%T) rc=$?" >> $B/times.log
echo ALLDONE2 >> $B/times.log
