"""Where a measurement came from: device, library versions, git commit, time."""

from __future__ import annotations

import datetime
import functools
import os
import platform
import subprocess

import torch


@functools.cache
def git_commit() -> str:
    """The checkout's commit, with '+dirty' when tracked files differ from it ('unknown' outside git).

    CS336_GIT_COMMIT, when set, names the commit instead: for copies of a checkout whose .git is
    absent or stale (a remote GPU machine given the working tree)."""
    if os.environ.get("CS336_GIT_COMMIT"):
        return os.environ["CS336_GIT_COMMIT"]
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=here, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + ("+dirty" if dirty else "")


def device_name(device: str | torch.device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def provenance(device: str | torch.device) -> dict[str, str]:
    """Columns every results row carries."""
    return {
        "device_name": device_name(device),
        "torch_version": torch.__version__,
        "triton_version": triton_version(),
        "cuda_version": torch.version.cuda or "none",
        "git_commit": git_commit(),
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "hostname": platform.node(),
    }
