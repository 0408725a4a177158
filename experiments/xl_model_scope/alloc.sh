export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 CS336_GIT_COMMIT=e196df1
A="--device cuda --sizes xl --modes train_step --models ours plain --precisions bf16 --attention sdpa --compile-scopes model --optimizers fused --weights bf16-master --warmup 5 --steps 15"
echo "== default"; timeout 260 python3 .lab/alloc.py $A --out $OUT/default.csv 2>&1 | grep -v Warn | tail -45
echo "== expandable"; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 260 python3 .lab/alloc.py $A --out $OUT/expandable.csv 2>&1 | grep -v Warn | tail -45
