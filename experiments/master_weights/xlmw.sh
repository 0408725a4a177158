#!/bin/bash
# #62 xl scratch: master weights (exp/master-weights 957a5d8) vs ours vs plain, compile=model, one call
export PYTHONUNBUFFERED=1
T0=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/device.txt
rm -rf /tmp/mw; cp -r $PWD/.lab/mw /tmp/mw
cd /tmp/mw && export PYTHONPATH=/tmp/mw
python3 - <<'PY' 2>&1 | tail -3
import copy, torch
from cs336_systems import TransformerLM, get_config
from cs336_systems.model.transformer import Linear
from cs336_systems.optim import AdamW, keep_master_weights
from cs336_systems.model.functional import cross_entropy
torch.manual_seed(0)
a = TransformerLM(get_config("small")).cuda(); b = copy.deepcopy(a)
oa = AdamW(a.parameters(), lr=1e-3, fused=True); ob = AdamW(b.parameters(), lr=1e-3, fused=True)
keep_master_weights(ob, [m.weight for m in b.modules() if isinstance(m, Linear)])
for step in range(3):
    x = torch.randint(a.config.vocab_size, (2, 129), device="cuda")
    for m, o in ((a, oa), (b, ob)):
        o.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cross_entropy(m(x[:, :-1]), x[:, 1:])
        loss.backward(); o.step()
d = max((ob.state[pb].get("master", pb) - pa).abs().max().item() for pa, pb in zip(a.parameters(), b.parameters()))
n = sum(not torch.equal(ob.state[pb].get("master", pb), pa) for pa, pb in zip(a.parameters(), b.parameters()))
print(f"GPU fused master check: max |master - fp32 autocast param| = {d:.3g}, tensors differing {n}")
PY
e() { timeout $2 python3 -m cs336_systems.bench.e2e --device cuda --batch-size 4 --context-length 512 --sizes xl \
   --modes train_step --models $3 --precisions bf16 --attention sdpa --compile-scopes model --optimizers fused \
   --warmup 5 --steps 10 --out $OUT/xl_$1.csv 2>$OUT/xl_$1.log; echo "$1 rc=$? at $(( $(date +%s) - T0 )) s"; }
e base ${BASE_S:-230} "ours plain"
CS336_MASTER_WEIGHTS=1 e master ${MW_S:-130} "ours"
python3 - <<'PY'
import pandas as pd, glob, os
for f in sorted(glob.glob(os.environ["OUT"]+"/xl_*.csv")):
    d = pd.read_csv(f); print(f.split("/")[-1], d[["model","phase","median_ms","mean_ms","status"]].to_string())
PY
