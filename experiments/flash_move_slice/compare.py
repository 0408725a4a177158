"""ours / cuDNN per shape of the slice after the move (H100) against the committed grid (H200), same shapes."""
import pandas as pd

key = ["batch", "heads", "seq_len", "head_dim", "causal", "pass"]


def ratios(frame: pd.DataFrame) -> pd.Series:
    table = frame[frame.status == "ok"].pivot_table(index=key, columns="provider", values="median_ms")
    return table["flash_triton"] / table["sdpa_cudnn"]


after = ratios(pd.read_csv("experiments/flash_move_slice/shapes_new.csv"))
grid = pd.read_csv("results/flash_llm_shapes.csv")
both = pd.concat({"after_h100": after, "grid_h200": ratios(grid[grid.dtype == "bf16"])}, axis=1).dropna()
print(both.round(3).to_string())
print(both.groupby(level="pass").median().round(3))
