"""The GPU archs kernelgen runs on and what each offers its kernels: the one table of per-arch hardware
facts that the backends' config spaces, defaults and feasibility rules read.

An arch is written as the GPU reports it (`kernelgen.device.device_arch`): "sm_80", "sm_89", "sm_90", ...;
"cpu" is Triton's interpreter, given sm_90's facts (CPU tests run the space and defaults of sm_90; the
interpreter has no shared memory limit and emulates TMA). An arch from sm_80 on that the table lacks (a newer
one) gets the most conservative facts of the table; one older than sm_80 is refused (the kernels need bf16
tensor cores).
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from .errors import KernelgenValueError

__all__ = ["ArchFacts", "ARCHS", "ANY_ARCH", "check_arch", "arch_facts"]


@dataclass(frozen=True)
class ArchFacts:
    """arch            "sm_89", or "cpu"
    smem_per_block  bytes of shared memory one program (CTA) may use, the opt-in maximum included
                    (CUDA's sharedMemPerBlockOptin)
    tma             the Tensor Memory Accelerator (tensor descriptors, cp.async.bulk.tensor)
    mma             the tensor-core instruction kernels are compiled to: "mma.sync" (fed by cp.async),
                    "wgmma" (warpgroup MMAs), or "unknown" (an arch the table lacks)"""

    arch: str
    smem_per_block: int
    tma: bool
    mma: str


# The CUDA C++ Programming Guide's table of compute capabilities ("Maximum amount of shared memory per
# thread block"), in order of capability.
ARCHS = {facts.arch: facts for facts in (
    ArchFacts("sm_80", 166912, tma=False, mma="mma.sync"),  # A100, A30: 163 KB
    ArchFacts("sm_86", 101376, tma=False, mma="mma.sync"),  # RTX 30xx, A10, A40: 99 KB
    ArchFacts("sm_87", 166912, tma=False, mma="mma.sync"),  # Jetson Orin: 163 KB
    ArchFacts("sm_89", 101376, tma=False, mma="mma.sync"),  # L4, L40, RTX 40xx: 99 KB
    ArchFacts("sm_90", 232448, tma=True, mma="wgmma"),  # H100, H200: 227 KB
)}
OLDEST_CAPABILITY = 80
# What an arch the table lacks (a newer one) is assumed to offer: no more than any arch of the table.
_NEWER = ArchFacts("", min(f.smem_per_block for f in ARCHS.values()), tma=False, mma="unknown")
# `Backend.infeasible(..., arch=ANY_ARCH)`: where no device is known yet (a config pinned before a call),
# why no arch the backend runs on can run the config.
ANY_ARCH = None


def check_arch(arch: str) -> str:
    """An arch kernelgen runs on: "sm_XY" (XY the compute capability, as CUDA's nvcc names it) from sm_80 on,
    or "cpu"."""
    if arch == "cpu":
        return arch
    if not (isinstance(arch, str) and re.fullmatch(r"sm_[1-9][0-9]{1,2}", arch) and 50 <= int(arch[3:]) <= 129):
        raise KernelgenValueError(f"arch={arch!r} is not a CUDA arch as the GPU reports it; expected sm_XY such as "
                                  "sm_80, sm_89 or sm_90 (or 'cpu' for the interpreter)")
    if int(arch[3:]) < OLDEST_CAPABILITY:
        raise KernelgenValueError(f"arch={arch!r} is older than kernelgen's kernels run on; expected "
                                  f"sm_{OLDEST_CAPABILITY} or newer (bf16 tensor cores)")
    return arch


def arch_facts(arch: str) -> ArchFacts:
    """What `arch` offers kernelgen's kernels (`ARCHS`; "cpu": sm_90's; one the table lacks: the least of it)."""
    if check_arch(arch) == "cpu":
        return dataclasses.replace(ARCHS["sm_90"], arch="cpu")
    return ARCHS.get(arch) or dataclasses.replace(_NEWER, arch=arch)
