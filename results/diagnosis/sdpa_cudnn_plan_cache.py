"""Is SDPA cuDNN's wrong backward (sdpa_cudnn_grad_strides.py) a plan kept from an earlier dO layout? Per shape, in a
fresh process, three backwards in a given order of dO layouts; the prediction if torch keeps the cuDNN backward plan
per shape without dO's strides: the first layout is right, a second that differs is wrong, and a third that matches
the first is right again. Prints dQ's relative error against float64 per call.

    python results/diagnosis/sdpa_cudnn_plan_cache.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sdpa_cudnn_grad_strides import grad_output  # noqa: E402

from cs336_systems.model.attention import get_attention, naive_attention  # noqa: E402

ORDERS = {640: ("contiguous", "like_q", "contiguous"), 768: ("like_q", "contiguous", "like_q"),
          896: ("like_q", "like_q", "contiguous")}

device = torch.device("cuda")
fn = get_attention("sdpa_cudnn")
generator = torch.Generator(device).manual_seed(0)
for seq, order in ORDERS.items():
    q, k, v = (torch.empty(1, seq, 8, 64, device=device, dtype=torch.bfloat16).normal_(generator=generator)
               .transpose(1, 2).requires_grad_() for _ in range(3))
    reference = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out = naive_attention(*reference, True)
    for call, layout in enumerate(order):
        out = fn(q, k, v, True)
        do = grad_output(layout, out, generator)
        dq = torch.autograd.grad(out, q, do)[0]
        want = torch.autograd.grad(ref_out, reference[0], do.double(), retain_graph=True)[0]
        error = ((dq.double() - want).norm() / want.norm()).item()
        print(f"seq {seq} call {call + 1} dO {layout:10s} dQ relative error {error:.2e}", flush=True)
