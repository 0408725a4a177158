"""Names as profilers report them, in plain Python (no torch): which kernels and ops are matrix multiplications,
and which names are ranges rather than kernels. Shared by the profiling benchmarks and the report."""

# Kernel and op names of matrix multiplications, as profilers name them (the report's kernel classes and
# bench.step_profile's categories). Recent cuBLAS names its Hopper GEMMs nvjet_* (e.g. nvjet_sm90_hss_320x128).
MATMUL = r"gemm|matmul|aten::mm|aten::bmm|aten::addmm|cutlass|xmma|wgmma|nvjet"

ATTENTION_STAGES = ("scores", "softmax", "final matmul")
OWN_RANGES = {"forward", "backward", "optimizer", "inference", *ATTENTION_STAGES}


def is_annotation(name: str) -> bool:
    """A range, not a kernel: ours, the profiler's step markers, or torch.optim's own
    `Optimizer.step#AdamW.step`, which the profiler also puts on the GPU timeline (with no CPU time), or the
    phase ranges of bench/step_profile.py (`step:forward`, ...)."""
    return name in OWN_RANGES or name.startswith(("ProfilerStep", "Optimizer.", "step:"))
