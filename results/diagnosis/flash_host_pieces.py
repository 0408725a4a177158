"""Host time of each piece of our attention's per-call path, measured on the CPU (no GPU, no interpreter).

    python results/diagnosis/flash_host_pieces.py [--out FILE.csv]

At short sequences our attention is host-bound (results/diagnosis/flash_host_floor.py, H100): the time to issue
a call is its wall time. Most of that host code is plain Python that runs the same with CPU tensors, so this
times it here, piece by piece, with the kernels' launches replaced by no-ops (the binary Triton would call is the
one thing not run; its own launcher, `CompiledKernel.run`, is not ours to shorten):
- settings:    one `flash_settings()` read (the environment's variables, cached on their raw values);
- launch:      one FastLauncher call on its fast path (key of the argument layout, arguments in signature order);
- descriptor:  one Gluon TMA descriptor (`flash_gluon._descriptor`), and the Gluon forward's `kernel_launch`
               (four descriptors and the argument tuple);
- op_custom_op, op_library: one call of an operator like our forward (q, k, v, is_causal -> two fresh tensors),
               registered with `torch.library.custom_op` or with the low-level `torch.library.Library`, called as a
               compiled graph calls it (gradients off): what each registration adds per call;
- fa2_eager:   the FA2 path's forward, and forward+backward, through `FlashAttentionTriton.apply` (every check,
               the dispatch, the settings, the launchers), kernels no-ops;
- fa2_compiled: the same through `torch.compile` (Inductor, static shapes): adds the custom operators' wrappers.
Each row is the median over repeats of timeit's per-call microseconds. Run from the commit to measure (it
imports the package it finds), e.g. before and after a change; kernels/NOTES.md, "Host floor", has the numbers.
"""

import argparse
import os
import statistics
import timeit

os.environ.pop("TRITON_INTERPRET", None)  # the kernels as on a GPU: compiled objects, FastLauncher's fast path on
os.environ["CS336_FLASH_TMA"] = "0"  # the TMA check asks the CUDA device (no CUDA here); the GPU takes pointer
# loads below 16384 keys anyway (FlashSettings.tma_min_keys)

import torch  # noqa: E402

from cs336_systems.kernels import flash_triton  # noqa: E402
from cs336_systems.kernels.settings import flash_settings  # noqa: E402

SHAPE = (1, 16, 1024, 128)  # batch, heads, sequence, head dim: the diagnosis's FA2 shape


class _NoOpKernel:
    """Stands for a Triton kernel: `kernel[grid](*args)` "launches" nothing and returns a compiled kernel whose
    `[grid]` runner does nothing, as FastLauncher's first call and fast path expect."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self

    def __call__(self, *args):
        return None


def stub_launches():
    """Every FastLauncher of flash_triton launches no-ops; the device check lets CPU tensors through."""
    flash_triton.check_kernel_device = lambda t, name: None
    for launcher in flash_triton.LAUNCH.values():
        if launcher.autotuner is not None:
            launcher.autotuner.best_config = launcher.autotuner.configs[0]
        launcher.kernel = _NoOpKernel()


def per_call_us(fn, number: int, repeats: int = 7) -> float:
    fn()
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeats)) / number * 1e6


def inputs(dtype=torch.bfloat16, grad=False):
    batch, heads, seq, dim = SHAPE
    # the model's layout: (batch, seq, heads, dim) viewed as (batch, heads, seq, dim)
    return [torch.randn(batch, seq, heads, dim, dtype=dtype).transpose(1, 2).requires_grad_(grad) for _ in range(3)]


def operator_calls() -> dict[str, float]:
    """us per call of two operators that differ only in how they are registered (a namespace of their own)."""
    def kernel(q, k, v, is_causal):
        return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)

    schema = "(Tensor q, Tensor k, Tensor v, bool is_causal) -> (Tensor, Tensor)"
    custom = torch.library.custom_op("host_pieces::custom_op_forward", kernel, mutates_args=(), schema=schema)
    library = torch.library.Library("host_pieces", "FRAGMENT")
    library.define("library_forward" + schema)
    library.impl("library_forward", kernel, "CPU")
    q, k, v = inputs(grad=True)
    rows = {}
    for name, op in (("op_custom_op", torch.ops.host_pieces.custom_op_forward.default),
                     ("op_library", torch.ops.host_pieces.library_forward.default)):
        def call(op=op):
            with torch.no_grad():
                op(q, k, v, True)

        rows[name] = per_call_us(call, 5000)
    del custom
    return rows


def pieces() -> dict[str, float]:
    rows = {"settings": per_call_us(flash_settings, 20000), **operator_calls()}
    stub_launches()
    q, k, v = inputs()
    out, lse = flash_triton.flash_forward(q, k, v, True)  # remembers the forward's layout
    launcher = flash_triton.LAUNCH["forward"]
    p = flash_triton._launch_params(q, k, flash_settings())
    args = (q, k, v, out, lse, *flash_triton._strides4(q), *flash_triton._strides4(k), *flash_triton._strides4(v),
            *flash_triton._strides4(out))
    kwargs = dict(qk_scale=0.1, IS_CAUSAL=True, TMA=False, **p)
    grid = lambda meta: (8, 16)  # noqa: E731
    launcher(grid, *args, **kwargs)
    rows["launch"] = per_call_us(lambda: launcher(grid, *args, **kwargs), 5000)

    try:
        from cs336_systems.kernels import flash_gluon
    except ImportError as error:
        print(f"flash_gluon does not import here ({error}): no descriptor rows")
    else:
        rows["descriptor"] = per_call_us(lambda: flash_gluon._descriptor(q, 64), 5000)
        lse4 = torch.empty(q.shape[:-1], dtype=torch.float32)
        rows["gluon_kernel_launch"] = per_call_us(lambda: flash_gluon.kernel_launch(q, k, v, out, lse4, True), 2000)

    qg, kg, vg = inputs(grad=True)
    do = torch.randn_like(qg)
    for name, fn in (("fa2_eager", flash_triton.FlashAttentionTriton.apply),
                     ("fa2_compiled", torch.compile(flash_triton.FlashAttentionTriton.apply, dynamic=False))):
        def forward(fn=fn):
            with torch.no_grad():
                fn(qg, kg, vg, True)

        def both(fn=fn):
            fn(qg, kg, vg, True).backward(do)
            qg.grad = kg.grad = vg.grad = None

        both()
        rows[f"{name}_forward"] = per_call_us(forward, 500)
        rows[f"{name}_forward_backward"] = per_call_us(both, 300)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the rows to this CSV (piece, us_per_call, torch_version)")
    out = parser.parse_args().out
    rows = pieces()
    for piece, us in rows.items():
        print(f"{piece:32s} {us:9.2f} us")
    if out:
        with open(out, "w") as file:
            file.write("piece,us_per_call,torch_version\n")
            file.writelines(f"{piece},{us:.3f},{torch.__version__}\n" for piece, us in rows.items())


if __name__ == "__main__":
    main()
