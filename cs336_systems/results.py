"""The one writer of results files: tidy CSV rows, written atomically (`write_rows`, `PartialRows`) or
appended and flushed row by row (`AppendedRows`, for a log that must survive a kill). Every file is made
with the user's normal permissions (0666 less the umask), as `open` makes it."""

from __future__ import annotations

import csv
import os
import secrets
from collections.abc import Iterable, Mapping
from pathlib import Path

import pandas as pd


def check_output_file(path: str | os.PathLike, what: str = "output file") -> Path:
    """path as a Path once it is known that a file can be written there: a ValueError naming it otherwise
    (a directory given as the file, a parent that is a file, a folder or a file without write permission).
    Folders that do not exist yet are fine: the writers make them. Called before a run starts, so that a
    bad path costs nothing."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{what} {str(path)!r} is a directory: name a file (e.g. {str(path / 'results.csv')!r})")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{what} {str(path)!r} is not writable")
    folder = path.parent
    while not folder.exists():  # the nearest existing folder is where mkdir will start
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{what} {str(path)!r}: {str(folder)!r} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {str(path)!r}: folder {str(folder)!r} is not writable")
    return path


def _temporary_beside(path: Path) -> Path:
    """A fresh name beside path, created empty by open(..., "x"): 0666 less the umask, where mkstemp's would
    be 0600 (and stay so after the rename)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    tmp.open("x").close()
    return tmp


def _replace_text(path: Path, text: str) -> None:
    """path's content replaced by text through a temporary file and a rename."""
    tmp = _temporary_beside(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink()
        raise


def write_rows(rows: Iterable[Mapping], path: str | os.PathLike) -> pd.DataFrame:
    """Write rows as CSV through a temporary file and a rename, so an interrupted run never leaves a
    half-written file in place of an earlier result."""
    frame = pd.DataFrame(list(rows))
    path = check_output_file(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_beside(path)
    try:
        with open(tmp, "w", newline="") as f:
            frame.to_csv(f, index=False)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink()
        raise
    return frame


class PartialRows:
    """Rows of a long sweep, kept on disk as they come: each `add` rewrites PATH.partial (atomically),
    and `finish` writes PATH and removes the partial file. A run cut off before the end leaves its
    finished points in PATH.partial, beside an earlier PATH, never in its place. PATH is checked on
    construction (`check_output_file`), before the sweep's first point."""

    def __init__(self, path: str | os.PathLike):
        self.path = check_output_file(path)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.rows: list[Mapping] = []

    def add(self, rows: Iterable[Mapping]) -> None:
        self.rows += list(rows)
        write_rows(self.rows, self.partial)

    def finish(self) -> pd.DataFrame:
        frame = write_rows(self.rows, self.path)
        self.partial.unlink(missing_ok=True)
        return frame


class AppendedRows:
    """A CSV log written row by row: each `append` adds one line and flushes it, so a run killed at any
    point leaves every row it finished (flushed to the OS: it survives the process, not a power cut).

    `keep_until=None` starts the file afresh; `keep_until=N` (a resumed run) keeps the existing rows whose
    `key` column is at most N, byte for byte, and drops the later ones (and a last line cut off by a kill),
    which the resumed run writes again. A row whose columns differ from the file's header rewrites the file
    (atomically) with the union of columns."""

    def __init__(self, path: str | os.PathLike, key: str = "step", keep_until: int | None = None):
        self.path = check_output_file(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        lines = self.path.read_text().splitlines(keepends=True) if keep_until is not None and self.path.exists() else []
        lines = [line for line in lines if line.endswith("\n")]  # a row cut off by a kill is dropped
        self.columns = next(csv.reader(lines[:1]), [])
        if lines:
            if key not in self.columns:
                raise ValueError(f"{str(self.path)!r} has no {key!r} column, so its rows past {keep_until} cannot be "
                                 "told apart: name a new file")
            at = self.columns.index(key)
            lines = lines[:1] + [line for line in lines[1:] if float(next(csv.reader([line]))[at]) <= keep_until]
        _replace_text(self.path, "".join(lines))

    def append(self, row: Mapping) -> None:
        if self.columns and list(row) != self.columns:
            frame = pd.concat([read_table(self.path), pd.DataFrame([row])], ignore_index=True)
            write_rows(frame.to_dict("records"), self.path)
            self.columns = list(frame.columns)
            return
        with open(self.path, "a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(row))
            if not self.columns:
                writer.writeheader()
                self.columns = list(row)
            writer.writerow(row)
            f.flush()


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
