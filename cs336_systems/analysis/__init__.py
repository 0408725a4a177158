"""Pure models that the benchmarks and the report both use: numbers from formulas and fits, no
torch.distributed, no plotting, no report text.

- `attention_math`: attention FLOP counts (FlashAttention-2's convention and what each backend executes)
  and naive attention's memory model;
- `collectives`: the ring model of all-reduce, all-gather and reduce-scatter, fitted to measured times;
- `ddp`: the all-reduce cost t = o + bytes/w, the bucket-size model and how many rounds a comparison needs;
- `fsdp_accounting`: model-state memory per rank under DDP, ZeRO-1 and FSDP;
- `parallelism`: the 2026 handout's section 8 (data, FSDP, tensor and 2-D parallelism), in sympy;
- `communication_accounting`: the 2025 handout's 2.4, the XXL model's memory and compute-bound batch;
- `snapshot`: reading allocator snapshots: live-tensor memory over the recorded window and each phase's levels.

bench/ and report/ import from here; nothing here imports either.
"""
