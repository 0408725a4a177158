#!/bin/bash
# Call 1 (#58): the README's test command on the GPU, then the leaderboard case before (144fd77) and after the move.
set -o pipefail
export PYTHONUNBUFFERED=1
T0=$(date +%s)
python3 -m pip install -q --no-index --find-links .whl snakemake pytest-xdist pytest-timeout 2>&1 | tail -2
NEW=$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a $OUT/device.txt
export TORCH_EXTENSIONS_DIR=/tmp/ext_new
PYTHONPATH=$NEW timeout ${TEST_S:-400} python3 -m pytest -q -n 16 -p no:cacheprovider 2>&1 | tee $OUT/gpu_test_suite.log | tail -30
echo "pytest rc=$? at $(( $(date +%s) - T0 )) s"
git worktree add -f /tmp/old 144fd77 >/dev/null 2>&1 || { mkdir -p /tmp/old && git archive 144fd77 | tar -x -C /tmp/old; }
lb() {  # tree tag commit round
  (cd $1 && CS336_GIT_COMMIT=$3 TORCH_EXTENSIONS_DIR=/tmp/ext_$2 PYTHONPATH=$1 timeout 100 python3 -m cs336_systems.bench.flash_bench \
     leaderboard --device cuda --heads 16 --seq-len 16384 --head-dim 64 --dtype bf16 --compile on \
     --providers flash_triton sdpa_cudnn --warmup-ms 300 --rep-ms 2000 --out $OUT/lb_$2_$4.csv 2>>$OUT/ab_$2.log)
  echo "lb $2 $4: $? at $(( $(date +%s) - T0 )) s"
}
lb $NEW new $CS336_GIT_COMMIT 1
lb /tmp/old old 144fd77 1
[ $(( $(date +%s) - T0 )) -lt 500 ] && lb $NEW new $CS336_GIT_COMMIT 2
[ $(( $(date +%s) - T0 )) -lt 540 ] && lb /tmp/old old 144fd77 2
for f in $OUT/lb_*.csv; do echo "== $f"; cat $f | cut -c1-400; done
