"""Handout 1.1.5: the four accumulation loops and the dtypes inside an FP16-autocast ToyModel, run for real.

    python -m cs336_systems.bench.mixed_precision --device cuda --out results/mixed_precision.csv

Rows: kind=accumulation (the loop, the value it printed, its error against 10) and kind=dtype (the
tensor and its dtype under autocast). Autocast uses float16 on CUDA as the handout asks; on a CPU
the same code runs CPU autocast, and the `device_type` column says which.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn as nn

from cs336_systems.bench.cli import add_device_argument, device_from_args
from cs336_systems.provenance import provenance
from cs336_systems.results import write_rows


def accumulation_loops() -> list[dict]:
    """The handout's four loops: 1000 additions of 0.01 in different precisions."""
    rows = []
    variants = [
        ("fp32 += fp32", torch.float32, torch.float32, False),
        ("fp16 += fp16", torch.float16, torch.float16, False),
        ("fp32 += fp16", torch.float32, torch.float16, False),
        ("fp32 += fp16.to(fp32)", torch.float32, torch.float16, True),
    ]
    for name, acc_dtype, term_dtype, upcast in variants:
        s = torch.tensor(0, dtype=acc_dtype)
        for _ in range(1000):
            x = torch.tensor(0.01, dtype=term_dtype)
            s += x.type(torch.float32) if upcast else x
        rows.append({"kind": "accumulation", "item": name, "value": float(s), "dtype": str(s.dtype),
                     "abs_error": abs(float(s) - 10.0)})
    return rows


class ToyModel(nn.Module):
    """The handout's model."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, out_features, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x):
        x = self.relu(self.fc1(x))
        x = self.ln(x)
        x = self.fc2(x)
        return x


def autocast_dtypes(device: torch.device) -> list[dict]:
    """What autocast(float16) does to each tensor of a ToyModel step, observed with forward hooks."""
    torch.manual_seed(0)
    model = ToyModel(16, 4).to(device)
    seen: dict[str, torch.dtype] = {}

    def record(name: str):
        def hook(module, inputs, output) -> None:  # returning None keeps the output as it is
            seen[name] = output.dtype

        return hook

    model.fc1.register_forward_hook(record("fc1 output"))
    model.ln.register_forward_hook(record("layer norm output"))
    x, y = torch.randn(8, 16, device=device), torch.randint(4, (8,), device=device)
    with torch.autocast(device_type=device.type, dtype=torch.float16):
        seen["parameters inside autocast"] = next(model.parameters()).dtype
        logits = model(x)
        seen["logits"] = logits.dtype
        loss = nn.functional.cross_entropy(logits, y)
        seen["loss"] = loss.dtype
    loss.backward()
    seen["gradients"] = model.fc1.weight.grad.dtype
    return [{"kind": "dtype", "item": item, "dtype": str(dtype)} for item, dtype in seen.items()]


def mixed_precision_rows(device: str | torch.device) -> list[dict]:
    """Both experiments' rows, with the device type and provenance."""
    device = torch.device(device)
    rows = [*accumulation_loops(), *autocast_dtypes(device)]
    return [{**row, "device_type": device.type, **provenance(device)} for row in rows]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_argument(parser)
    parser.add_argument("--out", required=True, help="CSV file for the rows")
    args = parser.parse_args(argv)
    device = device_from_args(parser, args.device)
    write_rows(mixed_precision_rows(device), args.out)


if __name__ == "__main__":
    main()
