"""What the process runs on: the CUDA arch of a device, and whether Triton's CPU interpreter is on."""
from __future__ import annotations

import functools
import os

import torch

__all__ = ["interpreting", "device_arch", "gpu_name", "current_arch"]


def interpreting() -> bool:
    """Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=None)
def _cuda_arch(index: int) -> tuple[str, str]:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm_{major}{minor}", torch.cuda.get_device_name(index)


def _index(device) -> int:
    device = torch.device(device)
    return torch.cuda.current_device() if device.index is None else device.index


def device_arch(device="cuda") -> str:
    """"sm_90" for an H100/H200 and so on; "cpu" for the CPU (kernels in the interpreter)."""
    if torch.device(device).type != "cuda":
        return "cpu"
    return _cuda_arch(_index(device))[0]


def gpu_name(device="cuda") -> str:
    """The GPU's name as CUDA reports it ("NVIDIA H200"); "cpu" for the CPU."""
    if torch.device(device).type != "cuda":
        return "cpu"
    return _cuda_arch(_index(device))[1]


def current_arch() -> str | None:
    """The arch of the current CUDA device, or None where there is none."""
    return device_arch("cuda") if torch.cuda.is_available() else None
