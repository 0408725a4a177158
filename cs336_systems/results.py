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


class PartialRows:
    """Rows of a long sweep, kept on disk as they come: each `add` rewrites PATH.partial (atomically),
    and `finish` writes PATH and removes the partial file. A run cut off before the end leaves its
    finished points in PATH.partial, beside an earlier PATH, never in its place."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.rows: list[Mapping] = []

    def add(self, rows: Iterable[Mapping]) -> None:
        self.rows += list(rows)
        write_rows(self.rows, self.partial)

    def finish(self) -> pd.DataFrame:
        frame = write_rows(self.rows, self.path)
        self.partial.unlink(missing_ok=True)
        return frame


# The columns every results row carries (provenance.provenance writes them).
PROVENANCE_COLUMNS = ("device_name", "torch_version", "triton_version", "cuda_version", "git_commit", "timestamp",
                      "hostname")
# Provenance columns read as text: a commit hash of digits, "e" and digits (8406e2351569102691...) is otherwise
# parsed as a float with a huge exponent, which crashed pandas 2.3.3's reader outright (a segmentation fault).
TEXT_COLUMNS = {"git_commit": str, "hostname": str, "run_id": str}


def read_table(path: str | os.PathLike) -> pd.DataFrame:
    """One results file, its provenance columns as text (TEXT_COLUMNS), its floats exactly as written (pandas'
    default parser can be a unit in the last place off, which a merge would then write back)."""
    return pd.read_csv(path, dtype=TEXT_COLUMNS, float_precision="round_trip")


def read_rows(*paths: str | os.PathLike) -> pd.DataFrame:
    """Concatenate results files (e.g. one per sweep job) into one frame."""
    return pd.concat([read_table(p) for p in paths], ignore_index=True)
