#!/bin/bash
# #58: flash_llm_shapes slice, before (144fd77) and after the move, one call; old first (it builds its extension).
T0=$(date +%s)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
NEW=$PWD
git worktree add -f /tmp/old 144fd77 >/dev/null 2>&1 || { mkdir -p /tmp/old && git archive 144fd77 | tar -x -C /tmp/old; }
sl() {  # tree tag commit seconds
  (cd $1 && CS336_GIT_COMMIT=$3 TORCH_EXTENSIONS_DIR=/tmp/ext_$2 PYTHONPATH=$1 timeout $4 python3 -m cs336_systems.bench.flash_bench \
     llm-shapes --device cuda --batch-heads 16 64 --seqs 4096 16384 --head-dims 64 128 --causal on \
     --max-tokens 2097152 --providers flash_triton sdpa_cudnn --warmup-ms 25 --rep-ms 100 --rounds 3 \
     --out $OUT/shapes_$2.csv 2>>$OUT/shapes_$2.log)
  echo "slice $2: $? at $(( $(date +%s) - T0 )) s"
}
sl /tmp/old old 144fd77 ${OLD_S:-190}
sl $NEW new $CS336_GIT_COMMIT $(( ${TOTAL_S:-300} - ($(date +%s) - T0) ))
