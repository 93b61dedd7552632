"""Which GPU each worker of one host uses and how much of it, and the start-up check that the
device a worker asks for is there and has room for its budget.

The rules are pure functions of plain numbers (`place_workers`, `memory_shortfall`,
`cuda_unavailable_reason`), tested exactly; `check_device` gathers torch's view of the
machine and applies them, so a worker fails in its first second with the versions and the
figures, not minutes later in an out-of-memory error or "Torch not compiled with CUDA".
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import NamedTuple

import torch

# The oldest NVIDIA driver branch each CUDA major version runs on (NVIDIA's release notes).
MIN_DRIVER_BRANCH = {12: "R525", 13: "R580"}
_DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")


class WorkerGpu(NamedTuple):
    device: str  # "cuda:1"
    gpu_memory_utilization: float  # this worker's fraction of the device's memory


def place_workers(num_workers: int, devices: list[str], utilization: float) -> list[WorkerGpu]:
    """Worker i (in start order) goes to devices[i % len(devices)], and the workers sharing a
    device split its `utilization` evenly (rounded down to 0.001, so the shares never add up
    to more). Two workers on one GPU at 0.9 get 0.45 each; four on two GPUs alternate.

    Raises:
        ValueError: no device, or so many workers on one device that a share rounds to 0.
    """
    if not devices:
        raise ValueError("no CUDA device to place workers on")
    on_device = [len(range(d, num_workers, len(devices))) for d in range(len(devices))]
    placed = []
    for i in range(num_workers):
        d = i % len(devices)
        share = math.floor(utilization / on_device[d] * 1000 + 1e-9) / 1000
        if share <= 0:
            raise ValueError(
                f"{on_device[d]} workers share {devices[d]}: gpu_memory_utilization "
                f"{utilization} leaves each less than 0.001 of it"
            )
        placed.append(WorkerGpu(devices[d], share))
    return placed


def memory_shortfall(
    device: str, utilization: float, free_bytes: int, total_bytes: int
) -> str | None:
    """Why `device` cannot give this worker its budget (utilization x its memory) now, or
    None when the free memory covers it. Other processes (another worker on the same GPU)
    hold what is not free."""
    need = utilization * total_bytes
    if free_bytes >= need:
        return None
    gib = 2**30
    return (
        f"{device} has {free_bytes / gib:.2f} GiB free of {total_bytes / gib:.2f} GiB "
        f"({(total_bytes - free_bytes) / gib:.2f} GiB held by other processes), but "
        f"gpu_memory_utilization {utilization} needs {need / gib:.2f} GiB: lower it (workers "
        "sharing a GPU split one budget) or give this worker its own GPU"
    )


def cuda_unavailable_reason(
    device: str,
    torch_version: str,
    torch_cuda: str | None,
    driver_version: str | None,
    num_devices: int,
) -> str | None:
    """Why the CUDA `device` cannot be used, naming torch's CUDA version and the driver
    found, or None when it can (or `device` is not CUDA)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return None
    asked = f"device {device!r} asked for, but"
    if torch_cuda is None:
        return f"{asked} torch {torch_version} is a CPU build (torch.version.cuda is None)"
    major = int(torch_cuda.split(".")[0])
    branch = MIN_DRIVER_BRANCH.get(major, f"one supporting CUDA {torch_cuda}")
    needs = (
        f"torch {torch_version} is built for CUDA {torch_cuda}, which needs an NVIDIA driver "
        f"{branch} or newer"
    )
    if num_devices == 0:
        driver = (
            "no NVIDIA driver was found" if driver_version is None
            else f"NVIDIA driver {driver_version} shows no CUDA device (too old, or none visible)"
        )  # fmt: skip
        return f"{asked} CUDA is unavailable: {needs}; {driver}"
    if dev.index is not None and dev.index >= num_devices:
        return f"{asked} only {num_devices} CUDA device(s) are visible (cuda:0..{num_devices - 1})"
    return None


def driver_version() -> str | None:
    """The loaded NVIDIA kernel driver's version ("580.65.06"), or None without one."""
    try:
        text = _DRIVER_VERSION_FILE.read_text()
    except OSError:
        return None
    found = re.search(r"Kernel Module\s+(?:for \S+\s+)?([\d.]+)", text)
    return found.group(1) if found else None


def cuda_devices(device: str) -> list[str]:
    """The devices "cuda" means on this host (every visible GPU), or [device] itself."""
    if torch.device(device).index is not None:
        return [device]
    return [f"cuda:{i}" for i in range(torch.cuda.device_count())]


def check_device(device: str, gpu_memory_utilization: float | None = None) -> None:
    """Fail fast when `device` cannot run a worker: CUDA missing (with torch's CUDA version
    and the driver found) or, with `gpu_memory_utilization`, too little free memory on it.
    Nothing for a CPU device.

    Raises:
        ValueError: naming the versions or the figures.
    """
    if torch.device(device).type != "cuda":
        return
    available = torch.cuda.is_available()
    reason = cuda_unavailable_reason(
        device,
        torch.__version__,
        torch.version.cuda,
        driver_version(),
        torch.cuda.device_count() if available else 0,
    )
    if reason is not None:
        raise ValueError(reason)
    if gpu_memory_utilization is not None:
        free, total = torch.cuda.mem_get_info(torch.device(device))
        short = memory_shortfall(device, gpu_memory_utilization, free, total)
        if short is not None:
            raise ValueError(short)
