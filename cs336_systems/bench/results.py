"""The one writer of results files: tidy CSV rows, written atomically."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

import pandas as pd


def write_rows(rows: Iterable[Mapping], path: str | os.PathLike) -> pd.DataFrame:
    """Write rows as CSV through a temporary file and a rename, so an interrupted run never leaves a
    half-written file in place of an earlier result."""
    frame = pd.DataFrame(list(rows))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", newline="") as f:
            frame.to_csv(f, index=False)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    return frame


def read_rows(*paths: str | os.PathLike) -> pd.DataFrame:
    """Concatenate results files (e.g. one per sweep job) into one frame."""
    return pd.concat([pd.read_csv(p) for p in paths], ignore_index=True)
