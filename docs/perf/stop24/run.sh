#!/bin/bash
# quiet-machine benchmark pass of stop 24 (AVX2 EPYC, 2 threads): the benchmarks whose code paths changed this round
cd /work/main
export OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE
B=/work/bench7
mkdir -p $B
run() { name=$1; shift; echo "== $name start $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)" >> $B/times.log
  .venv/bin/python "$@" > $B/$name.log 2>&1; echo "== $name end $(date -u +%T) rc=$?" >> $B/times.log; }
run bf16_e2e docs/perf/bf16_12e/e2e.py 64 2 5
run llm_bf16_b1 benchmarks/llm.py --batches 1 --dtypes bfloat16 --new 256 --repeats 3 --threads 2 --ab-tiles --out $B/llm_bf16_b1
run serve benchmarks/serve.py --parts load static --repeats 2 --out $B/serve/serve.json
run ft_bf16 benchmarks/finetune_encoder.py --dtypes bf16 --warmup 1 --repeats 1 --no-recipes --no-padded-row --no-mkl-row --threads 2 --out $B/ft_bf16
run llm_bf16_b8 benchmarks/llm.py --batches 8 --dtypes bfloat16 --new 256 --repeats 2 --threads 2 --ab-tiles --out $B/llm_bf16_b8
echo ALLDONE >> $B/times.log
