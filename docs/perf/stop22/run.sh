#!/bin/bash
# quiet-machine benchmark pass of stop 22 (AVX2 EPYC, 2 threads): the benchmarks whose code paths changed this round
# run3.sh expects stop 21's tree at /tmp/old21: git archive a962f74 src benchmarks | tar -x -C /tmp/old21
cd /work/main
B=/work/bench5
run() { name=$1; shift; echo "== $name start $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)" >> $B/times.log
  .venv/bin/python "$@" > $B/$name.log 2>&1; echo "== $name end $(date -u +%T) rc=$?" >> $B/times.log; }
run llm benchmarks/llm.py --batches 1 8 --dtypes float32 --new 128 --repeats 5 --threads 2 --ab --out $B/llm
run floor benchmarks/decode_floor.py --threads 2 --steps 64 --repeats 7 --ab-step --out $B/floor --md $B/decode_floor.md
run train benchmarks/train_vs_nanogpt.py --nanogpt /work/nanogpt/model.py --precisions fp32 --rounds 10 --steps 2 --out $B/train
run serve benchmarks/serve.py --repeats 2 --out $B/serve/serve.json
run serve_llama benchmarks/serve.py --family llama --parts load --clients 32 --prompt-max 256 --new-max 128 --out $B/serve/serve_llama.json
run prefill benchmarks/prefill.py --threads 2 --repeats 4 --ablate --out $B/prefill --md $B/prefill.md
run beam benchmarks/seq2seq_beam.py --repeats 6 --threads 2 --out $B/beam
run finetune benchmarks/finetune_encoder.py --dtypes fp32 --repeats 4 --threads 2 --out $B/finetune
echo ALLDONE >> $B/times.log
