#!/bin/bash
# A/B of the batch x heads tuning key: before (ab/before, 01d971f) and after (this tree), alternated, one machine.
set -u
AFTER=$1
ARGS="llm-shapes --batch-heads 16 64 256 512 --seqs 512 1024 --head-dims 64 128 --causal on off --providers flash_triton sdpa_flash sdpa_cudnn --rounds 3"
for i in 1 2; do
  for tree in before after; do
    if [ $tree = before ]; then pp=$PWD/ab/before; c=01d971f; else pp=$PWD; c=$AFTER; fi
    start=$(date +%s)
    PYTHONPATH=$pp CS336_GIT_COMMIT=$c python3 -m cs336_systems.bench.flash_bench $ARGS --out $OUT/${tree}_$i.csv 2> $OUT/${tree}_$i.log
    echo "$tree $i rc=$? $(( $(date +%s) - start )) s"
  done
done
