"""Before (144fd77) and after the package move, one H100, one call: ours ÷ cuDNN per shape and ours' own time change
against the larger of the two runs' round-to-round spreads. Usage: python compare.py (in this folder)."""
import pandas as pd

KEY = ["batch", "heads", "seq_len", "head_dim", "causal", "pass"]
old, new = (pd.read_csv(f"shapes_{tag}.csv") for tag in ("old", "new"))
ratios = {tag: d.pivot_table(index=KEY, columns="provider", values="median_ms").eval("flash_triton / sdpa_cudnn")
          for tag, d in (("old", old), ("new", new))}
print(pd.DataFrame(ratios).groupby(level="pass").median().round(3))
ours = old.merge(new, on=KEY + ["provider"], suffixes=("_old", "_new")).query("provider == 'flash_triton'")
ours = ours.assign(change=ours.median_ms_new / ours.median_ms_old - 1,
                   spread=ours[["spread_old", "spread_new"]].max(axis=1))
print(ours[KEY + ["change", "spread"]].round(3).to_string(index=False))
print(f"within spread: {(ours.change.abs() <= ours.spread).sum()} of {len(ours)}")
