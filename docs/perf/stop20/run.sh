#!/bin/bash
# quiet-machine benchmark pass of stop 20 (AVX2 EPYC, 2 threads)
cd /work/main
B=/work/bench3
run() { name=$1; shift; echo "== $name start $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)" >> $B/times.log
  .venv/bin/python "$@" > $B/$name.log 2>&1; echo "== $name end $(date -u +%T) rc=$?" >> $B/times.log; }
run nanogpt benchmarks/train_vs_nanogpt.py --nanogpt /work/nanogpt/model.py --precisions fp32 --rounds 10 --steps 2 --threads 2 --out $B/nanogpt
run linear benchmarks/linear_backend.py --rounds 12 --steps 3 --threads 2 --bert-layers 2 --out $B/linear
run ft_enc benchmarks/finetune_encoder.py --repeats 6 --warmup 2 --dtypes fp32 --threads 2 --out $B/ft_enc
run beam benchmarks/seq2seq_beam.py --repeats 6 --threads 2 --out $B/beam
run paged benchmarks/paged_engine.py --out $B/paged
run llm benchmarks/llm.py --repeats 3 --new 128 --dtypes float32 --threads 2 --out $B/llm
run prefill benchmarks/prefill.py --threads 2 --repeats 5 --out $B/prefill --md $B/prefill.md
run floor benchmarks/decode_floor.py --threads 2 --steps 64 --repeats 5 --ab --out $B/floor --md $B/decode_floor.md
run serve benchmarks/serve.py --repeats 2 --out $B/serve
run train_vs_hf benchmarks/train_vs_hf.py --warmup 2 --repeats 7 --steps 1 --out $B/train_vs_hf
echo ALLDONE >> $B/times.log
