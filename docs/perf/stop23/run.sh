#!/bin/bash
# quiet-machine benchmark pass of stop 23 (AVX2 EPYC, 2 threads): the benchmarks whose code paths changed this round
cd /work/main
B=/work/bench6
run() { name=$1; shift; echo "== $name start $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)" >> $B/times.log
  .venv/bin/python "$@" > $B/$name.log 2>&1; echo "== $name end $(date -u +%T) rc=$?" >> $B/times.log; }
run serve benchmarks/serve.py --repeats 2 --out $B/serve/serve.json
run beam benchmarks/seq2seq_beam.py --repeats 6 --threads 2 --ab --out $B/beam
run llm_bf16_b1 benchmarks/llm.py --batches 1 --dtypes bfloat16 --new 256 --repeats 3 --threads 2 --ab-tiles --out $B/llm_bf16_b1
run llm_fp32 benchmarks/llm.py --batches 1 8 --dtypes float32 --new 128 --repeats 3 --threads 2 --out $B/llm_fp32
run llm_bf16_b8 benchmarks/llm.py --batches 8 --dtypes bfloat16 --new 256 --repeats 2 --threads 2 --out $B/llm_bf16_b8
run train_floor benchmarks/train_floor.py --nanogpt /work/nanogpt/model.py --rounds 10 --out $B/train_floor
run serve_llama benchmarks/serve.py --family llama --parts load --out $B/serve/serve_llama_full.json
echo ALLDONE >> $B/times.log
