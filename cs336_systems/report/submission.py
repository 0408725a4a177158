"""code.zip, the code half of what the course asks a student to hand in (the other half is writeup.pdf).

    python -m cs336_systems.report.submission --out results/code.zip

The handout asks for "code.zip: all the code you've written", which its test_and_make_submission.sh makes by zipping
the repository root: the package, tests/ (with tests/adapters.py, which the course's tests import), and the files
beside them, paths relative to the root. Ours holds the package, the tests, the workflow and its config, the CI
script, README.md and pyproject.toml: everything needed to install, test and rerun, and none of the measured results,
figures, caches or git data. The archive is deterministic: files in sorted order, every entry dated 1980-01-01 with
mode 644 (755 where the file is executable), so the same sources give the same bytes.
"""

from __future__ import annotations

import argparse
import os
import zipfile
from pathlib import Path

CODE = (".ci", "README.md", "config.yaml", "conftest.py", "cs336_systems", "pyproject.toml", "tests", "workflow")
SKIPPED_FOLDERS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".snakemake", ".ipynb_checkpoints"}
SKIPPED_SUFFIXES = (".pyc", ".pyo", ".so", ".partial", ".egg-info")
EPOCH = (1980, 1, 1, 0, 0, 0)  # the earliest date a zip entry can carry


def submission_files(root: str | Path = ".") -> list[str]:
    """The files code.zip holds, as sorted paths relative to `root` (with '/')."""
    root = Path(root)
    missing = [name for name in CODE if not (root / name).exists()]
    if missing:
        raise FileNotFoundError(f"{root.resolve()} is not the repository root: it lacks {', '.join(missing)}")
    found = []
    for name in CODE:
        path = root / name
        if path.is_file():
            found.append(name)
            continue
        for folder, subfolders, files in os.walk(path):
            subfolders[:] = [s for s in subfolders if s not in SKIPPED_FOLDERS and not s.endswith(SKIPPED_SUFFIXES)]
            found += [(Path(folder) / f).relative_to(root).as_posix()
                      for f in files if not f.endswith(SKIPPED_SUFFIXES)]
    return sorted(found)


def write_zip(root: str | Path, out: str | Path) -> list[str]:
    """Write code.zip of the repository at `root` to `out`; the paths it holds."""
    root, names, out = Path(root), submission_files(root), Path(out)
    partial = out.with_name(out.name + ".tmp")  # renamed into place once whole: a failed run leaves no half zip
    with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name in names:
            entry = zipfile.ZipInfo(name, date_time=EPOCH)
            entry.compress_type = zipfile.ZIP_DEFLATED
            entry.external_attr = (0o755 if os.access(root / name, os.X_OK) else 0o644) << 16
            archive.writestr(entry, (root / name).read_bytes())
    partial.replace(out)
    return names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", default=".", help="the repository root (default: the working folder)")
    parser.add_argument("--out", required=True, help="the zip to write")
    args = parser.parse_args(argv)
    names = write_zip(args.root, args.out)
    print(f"{args.out}: {len(names)} files", *names, sep="\n")


if __name__ == "__main__":
    main()
