"""Training checkpoints: one folder per saved step, one file per rank, verified on resume.

Layout of a checkpoint folder (`--checkpoint-dir`):

    LOCK                      held (fcntl.flock) by the run using the folder; records its pid and host
    step_000100/rank0.pt      each rank's state (with a sharded optimizer each rank owns a different shard)
    step_000100/rank1.pt
    step_000100/COMPLETE      JSON: step, world_size, the run's identity, and the SHA-256 of every rank file

Saving: every rank writes its file (a temporary file, then a rename) while hashing the bytes it hands to the
disk, reads the file back and checks the hash (a bad write fails here, not at the resume); once every rank has
(a barrier and a gather of the hashes), rank 0 writes COMPLETE with the hashes and the run's identity. Only then
are older steps deleted, beyond the newest `keep` complete steps up to this one: a step is never deleted before
a newer one is written and verified.

Resuming: the newest complete step whose identity matches this run and whose rank files all hash as recorded
is loaded (`torch.load(weights_only=True)`: no code runs from a checkpoint file). A newer step that fails
(a truncated, emptied, zero-filled or missing rank file, an unreadable marker) is skipped with a warning naming
it; a run whose identity differs from the checkpoint's (another size, wrapper, optimizer sharding or number of
ranks) is refused with a message naming both values, before any state is read.

The lock: a second run on the same folder is refused at once, naming the run that holds it. It is an
`fcntl.flock`, which the kernel drops when its process ends, so a run killed with kill -9 leaves no stale lock
(the LOCK file stays, unlocked, and the next run takes it). Local filesystems only: flock over NFS may not lock.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import warnings
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

COMPLETE = "COMPLETE"  # the marker file of a step every rank has saved
LOCK = "LOCK"
_CHUNK = 1 << 24  # bytes hashed at a time


class CheckpointError(ValueError):
    """A checkpoint folder this run cannot use: another run's checkpoints, no intact step, or the folder in use.
    Raised on every rank alike (rank 0 decides and tells the others), so a CLI can report it and exit."""


@dataclass(frozen=True)
class RunIdentity:
    """What a checkpoint must match to be resumed: the state's shapes (size), its layout (the data-parallel kind,
    e.g. FSDP's sharded parameters, and the optimizer sharding) and the number of rank files. The bucket size,
    context length, learning rate and data are not part of it: they change no saved tensor."""

    size: str
    wrapper: str
    optimizer_sharding: str
    world_size: int

    def mismatch(self, saved: dict) -> str | None:
        """A message naming each field where `saved` (a COMPLETE marker's "run") differs, else None."""
        diffs = [f"{name} {saved.get(name)!r} (this run: {value!r})" for name, value in asdict(self).items()
                 if saved.get(name) != value]
        return "; ".join(diffs) or None


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"step_{step:06d}"


def saved_steps(root: Path, complete_only: bool = True) -> list[int]:
    """Steps with a folder under root, oldest first (only those marked complete, by default)."""
    steps = []
    for path in Path(root).glob("step_*"):
        number = path.name.removeprefix("step_")
        if path.is_dir() and number.isdigit() and (not complete_only or (path / COMPLETE).exists()):
            steps.append(int(number))
    return sorted(steps)


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class _HashingWriter:
    """A binary file that hashes what is written to it (torch.save writes through `write`)."""

    def __init__(self, f):
        self.f, self.digest = f, hashlib.sha256()

    def write(self, data) -> int:
        self.digest.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def _save_verified(state: dict, path: Path) -> str:
    """torch.save(state) to path through a temporary file and a rename (a save killed midway leaves no
    half-written file under path), synced to the disk; the SHA-256 of what was written, checked against the
    file read back."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        writer = _HashingWriter(f)
        torch.save(state, writer)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    written, read_back = writer.digest.hexdigest(), file_sha256(path)
    if written != read_back:
        raise OSError(f"checkpoint {path} reads back with SHA-256 {read_back}, not the {written} written")
    return written


def save_checkpoint(root: Path, step: int, state: dict, rank: int, run: RunIdentity, keep: int) -> None:
    """Every rank writes and verifies its file of the step; once all have, rank 0 marks the step complete
    (recording every file's hash and the run's identity) and deletes the older steps beyond the newest `keep`
    complete ones."""
    folder = step_dir(root, step)
    folder.mkdir(parents=True, exist_ok=True)
    digest = _save_verified(state, folder / f"rank{rank}.pt")
    digests = [None] * run.world_size
    dist.all_gather_object(digests, digest)  # also the barrier: every rank's file is written and verified
    if rank != 0:
        return
    marker = {"step": step, "world_size": run.world_size, "run": asdict(run),
              "files": {f"rank{r}.pt": d for r, d in enumerate(digests)}}
    tmp = folder / (COMPLETE + ".tmp")
    tmp.write_text(json.dumps(marker, indent=1))
    os.replace(tmp, folder / COMPLETE)
    # Only older steps: nothing there is being written (every rank is past them), and a partial folder left by
    # a killed run is cleared once a newer step is complete. Steps past this one (of a run resumed from an
    # earlier step, after theirs failed verification) neither count towards `keep` nor are deleted here: the
    # run overwrites them as it passes them.
    kept = {s for s in saved_steps(root) if s <= step}
    kept = set(sorted(kept)[-keep:])
    for old in saved_steps(root, complete_only=False):
        if old < step and old not in kept:
            shutil.rmtree(step_dir(root, old), ignore_errors=True)


def _read_marker(folder: Path) -> dict:
    """The COMPLETE marker of a step folder; a ValueError saying what is wrong with it."""
    try:
        marker = json.loads((folder / COMPLETE).read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"its {COMPLETE} marker cannot be read ({error})") from None
    if not isinstance(marker, dict) or not isinstance(marker.get("files"), dict) or "run" not in marker:
        raise ValueError(f"its {COMPLETE} marker records no checksums (written by an older version)")
    return marker


def _check_file(folder: Path, name: str, expected: str | None) -> str | None:
    """What is wrong with one rank file of a step (None: it hashes as recorded)."""
    path = folder / name
    if expected is None:
        return f"{name} has no recorded checksum"
    if not path.is_file():
        return f"{name} is missing"
    if path.stat().st_size == 0:
        return f"{name} is empty"
    actual = file_sha256(path)
    return None if actual == expected else f"{name} does not match its recorded checksum (damaged or truncated)"


def _choose_step(root: Path, rank: int, run: RunIdentity) -> int | None:
    """The newest complete step of root whose files all verify, the same on every rank (None: no complete
    step). Rank 0 checks markers and identity; each rank then hashes its own file of a candidate, and the
    problems are gathered, so the ranks verify in parallel and all fail or fall back alike."""
    candidates = [saved_steps(root)[::-1] if rank == 0 else None, None]  # (steps newest first, refusal)
    markers = {}
    if rank == 0:
        for step in candidates[0]:
            try:
                markers[step] = _read_marker(step_dir(root, step))
            except ValueError as error:
                markers[step] = str(error)
        newest = next((m for m in markers.values() if isinstance(m, dict)), None)
        if newest is not None and (diff := run.mismatch(newest["run"])):
            candidates[1] = (f"--checkpoint-dir {str(root)!r} holds the checkpoints of another run: {diff}; resume "
                             "with that run's settings, or name another folder")
    dist.broadcast_object_list(candidates, src=0)
    if candidates[1]:
        raise CheckpointError(candidates[1])
    skipped = []
    for step in candidates[0]:
        marker = [markers.get(step)]
        dist.broadcast_object_list(marker, src=0)
        marker = marker[0]
        if isinstance(marker, str):
            problem = marker
        else:
            problem = _check_file(step_dir(root, step), f"rank{rank}.pt", marker["files"].get(f"rank{rank}.pt"))
        problems = [None] * run.world_size
        dist.all_gather_object(problems, problem)
        problems = sorted({p for p in problems if p})
        if not problems:
            if skipped and rank == 0:
                warnings.warn(f"resuming from step {step} of {root}, the newest intact checkpoint; skipped: "
                              + "; ".join(skipped), RuntimeWarning, stacklevel=3)
            return step
        skipped.append(f"step {step} ({', '.join(problems)})")
    if skipped:
        raise CheckpointError(f"--checkpoint-dir {str(root)!r} holds no intact checkpoint: " + "; ".join(skipped)
                         + ". Move the folder away to start afresh")
    return None


def load_checkpoint(root: Path, rank: int, run: RunIdentity, device: torch.device) -> dict | None:
    """This rank's state at the newest complete, verified step of this run (all ranks load the same step), or
    None when there is no complete step. A CheckpointError for another run's checkpoints, or when every
    complete step is damaged."""
    step = _choose_step(Path(root), rank, run)
    if step is None:
        return None
    return torch.load(step_dir(root, step) / f"rank{rank}.pt", map_location=device, weights_only=True)


def _lock_holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "an unknown process"
    except OSError:
        return "an unknown process"


@contextmanager
def checkpoint_lock(root: Path | None, rank: int):
    """Hold root's LOCK for the block (rank 0 takes it; every rank learns whether it could, so all stop
    together): a CheckpointError naming the holder when another run has the folder. root None: no lock."""
    held, error = None, [None]
    if root is not None and rank == 0:
        Path(root).mkdir(parents=True, exist_ok=True)
        path = Path(root) / LOCK
        held = open(path, "a+")
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            error[0] = (f"--checkpoint-dir {str(root)!r} is in use by another run ({_lock_holder(path)}); wait for "
                        "it to finish, or name another folder")
            held.close()
            held = None
        else:
            held.truncate(0)
            held.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
            held.flush()
    if root is not None:
        dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise CheckpointError(error[0])
    try:
        yield
    finally:
        if held is not None:
            held.close()  # closing the file releases the flock
