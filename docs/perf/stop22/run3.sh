#!/bin/bash
cd /work/main
B=/work/bench5
while ! grep -q ALLDONE2 $B/times.log; do sleep 5; done
echo "== beam_old21 start $(date -u +%T) load $(cut -d' ' -f1 /proc/loadavg)" >> $B/times.log
.venv/bin/python /tmp/old21/benchmarks/seq2seq_beam.py --repeats 6 --threads 2 --out $B/beam_old21 > $B/beam_old21.log 2>&1
echo "== beam_old21 end $(date -u +%T) rc=$?" >> $B/times.log
echo ALLDONE3 >> $B/times.log
