#!/bin/bash
# quiet-machine benchmark pass of stop 21 (AVX2 EPYC, 2 threads): the benchmarks whose code paths changed this round
cd /work/main
B=/work/bench4
run() { name=$1; shift; echo "== $name start $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)" >> $B/times.log
  .venv/bin/python "$@" > $B/$name.log 2>&1; echo "== $name end $(date -u +%T) rc=$?" >> $B/times.log; }
run llm benchmarks/llm.py --repeats 3 --new 128 --dtypes float32 --threads 2 --ab --out $B/llm
run beam benchmarks/seq2seq_beam.py --repeats 6 --threads 2 --out $B/beam
run prefill benchmarks/prefill.py --threads 2 --repeats 5 --ablate --out $B/prefill --md $B/prefill.md
run paged benchmarks/paged_engine.py --out $B/paged
run serve benchmarks/serve.py --repeats 2 --out $B/serve
echo ALLDONE >> $B/times.log
