#!/bin/bash
# #62: master weights, deterministic GPU check (control: autocast twice) and same-run timing against plain
export PYTHONUNBUFFERED=1 CUBLAS_WORKSPACE_CONFIG=:4096:8
T0=$(date +%s)
rm -rf /tmp/mw; cp -r $PWD/.lab/mw /tmp/mw; cd /tmp/mw && export PYTHONPATH=/tmp/mw
timeout 90 python3 - <<'PY' 2>&1 | tail -4
import copy, torch
torch.use_deterministic_algorithms(True)
from cs336_systems import TransformerLM, get_config
from cs336_systems.model.transformer import Linear
from cs336_systems.optim import AdamW, keep_master_weights
from cs336_systems.model.functional import cross_entropy
torch.manual_seed(0)
a = TransformerLM(get_config("small")).cuda(); c = copy.deepcopy(a); b = copy.deepcopy(a)
oa, oc, ob = (AdamW(m.parameters(), lr=1e-3, fused=True) for m in (a, c, b))
keep_master_weights(ob, [m.weight for m in b.modules() if isinstance(m, Linear)])
for step in range(3):
    x = torch.randint(a.config.vocab_size, (2, 129), device="cuda")
    for m, o in ((a, oa), (c, oc), (b, ob)):
        o.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = cross_entropy(m(x[:, :-1]), x[:, 1:])
        loss.backward(); o.step()
def cmp(o, m):
    d = max((o.state[pb].get("master", pb) - pa).abs().max().item() for pa, pb in zip(a.parameters(), m.parameters()))
    n = sum(not torch.equal(o.state[pb].get("master", pb), pa) for pa, pb in zip(a.parameters(), m.parameters()))
    return f"max diff {d:.3g}, tensors differing {n}"
print("deterministic: control (autocast twice):", cmp(oc, c), "| master weights vs autocast:", cmp(ob, b))
PY
echo "check at $(( $(date +%s) - T0 )) s"
CS336_MASTER_WEIGHTS=1 timeout 230 python3 -m cs336_systems.bench.e2e --device cuda --batch-size 4 --context-length 512 --sizes xl \
   --modes train_step --models ours plain --precisions bf16 --attention sdpa --compile-scopes model --optimizers fused \
   --warmup 5 --steps 10 --out $OUT/xl_mw_plain.csv 2>$OUT/xl_mw_plain.log; echo "rc=$? at $(( $(date +%s) - T0 )) s"
python3 -c "
import pandas as pd; d=pd.read_csv('$OUT/xl_mw_plain.csv'); print(d[['model','phase','median_ms','mean_ms','status']].to_string())"
