#!/bin/bash
# #62: (1) where bf16 master weights and autocast part on the GPU (one backward: logits, loss, grads), (2) the
# e2e_baseline rule's command (both weights, both whole-model scopes).
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s)
CUBLAS_WORKSPACE_CONFIG=:4096:8 timeout 120 python3 - <<'PY' 2>&1 | tail -30
import copy, torch
torch.use_deterministic_algorithms(True)
from cs336_systems import TransformerLM, get_config
from cs336_systems.model.transformer import Linear
from cs336_systems.optim import AdamW, keep_master_weights
from cs336_systems.model.functional import cross_entropy
for attn in ("sdpa", "naive"):
    torch.manual_seed(0)
    cfg = get_config("small", attention=attn)
    a = TransformerLM(cfg).cuda(); b = copy.deepcopy(a)
    ob = AdamW(b.parameters(), lr=1e-3, fused=True)
    keep_master_weights(ob, [m.weight for m in b.modules() if isinstance(m, Linear)])
    x = torch.randint(cfg.vocab_size, (2, 129), device="cuda")
    out = {}
    for name, m in (("autocast", a), ("master", b)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = m(x[:, :-1]); loss = cross_entropy(logits, x[:, 1:])
        loss.backward(); out[name] = (logits.detach().float(), loss.item())
    print(attn, "logits equal:", torch.equal(*[o[0] for o in out.values()]),
          "max diff %.3g" % (out["autocast"][0] - out["master"][0]).abs().max().item(), "loss", out["autocast"][1], out["master"][1])
    bad = [(n, str(pb.grad.dtype), torch.equal(pa.grad.to(pb.grad.dtype), pb.grad), "%.3g" % (pa.grad - pb.grad.float()).abs().max().item(), "%.3g" % pa.grad.abs().max().item())
           for (n, pa), pb in zip(a.named_parameters(), b.parameters()) if not torch.equal(pa.grad, pb.grad.float())]
    print(f"  grads differing: {len(bad)} of {len(list(a.parameters()))}")
    for r in bad[:8]: print("   ", r)
PY
echo "check at $(( $(date +%s) - T0 )) s"
timeout ${E2E_S:-440} python3 -m cs336_systems.bench.e2e --device cuda --sizes xl --modes train_step --models ours plain \
  --precisions bf16 --attention sdpa --compile-scopes ${SCOPES:-model model-cudagraphs} --optimizers fused --weights float32 bf16-master \
  --warmup 5 --steps 10 --out $OUT/e2e_baseline.csv 2> $OUT/e2e_baseline.log
echo "e2e rc=$? at $(( $(date +%s) - T0 )) s"; tail -8 $OUT/e2e_baseline.log; ls $OUT
