"""kernelgen: compiler and autotuner for run-time, content-dependent block-sparse attention.

    spec = kernelgen.Spec(head_dim=128, kv_block=64, q_tile=64, top_k=16, causal=True, gqa_group=4)
    attn = kernelgen.get_kernel(spec)
    o = attn(q, k, v)
"""
import os as _os

import torch as _torch

# Without a CUDA device the kernels can only run in Triton's interpreter, which must be chosen before
# triton.language is first imported.
if "TRITON_INTERPRET" not in _os.environ and not _torch.cuda.is_available():
    _os.environ["TRITON_INTERPRET"] = "1"

if _os.environ.get("TRITON_INTERPRET") == "1":
    from .device import interpreter_numpy_problem as _interpreter_numpy_problem

    if _interpreter_numpy_problem():  # said before a kernel runs into it; a launch that does raises it
        import warnings as _warnings

        _warnings.warn(_interpreter_numpy_problem(), stacklevel=2)

from . import backends, reference  # noqa: E402
from .backends.gluon import GluonAttnConfig  # noqa: E402
from .backends.tilelang import TileLangAttnConfig, TileLangBwdDkdvConfig  # noqa: E402
from .backends.triton import (AttnConfig, BwdDkdvConfig, BwdDqConfig, DecodeConfig, IndexSelectConfig,  # noqa: E402
                                KvAttnConfig, KvBwdConfig, KvIndexSelectConfig, KvSelectConfig, KvUnionBwdConfig,
                                KvUnionConfig, SelectConfig)
from .dispatch import SparseAttention, get_kernel  # noqa: E402
from . import custom_ops  # noqa: E402,F401  (registers the ops that calls under torch.compile run)
from .errors import (KernelgenError, KernelgenNotImplementedError, KernelgenRuntimeError, KernelgenTypeError,  # noqa: E402
                     KernelgenValueError)
from .inputs import BlockLists, KeyReps  # noqa: E402
from .interop import from_block_mask, from_fla_lists, from_flashinfer_pages, to_block_mask  # noqa: E402
from .reverse_index import ReverseIndex, build_reverse_index  # noqa: E402
from .spec import Spec  # noqa: E402

__all__ = ["Spec", "get_kernel", "SparseAttention", "BlockLists", "KeyReps", "ReverseIndex", "build_reverse_index",
           "AttnConfig",
           "SelectConfig", "IndexSelectConfig", "BwdDqConfig", "BwdDkdvConfig", "KvSelectConfig", "KvAttnConfig",
           "KvUnionConfig", "KvUnionBwdConfig", "KvBwdConfig", "KvIndexSelectConfig", "DecodeConfig",
           "TileLangAttnConfig", "TileLangBwdDkdvConfig", "GluonAttnConfig",
           "KernelgenError", "KernelgenValueError", "KernelgenTypeError",
           "KernelgenRuntimeError", "KernelgenNotImplementedError", "backends", "reference", "from_block_mask",
           "from_fla_lists", "from_flashinfer_pages", "to_block_mask"]
__version__ = "0.1.0"

# Submodules that cost an import of their own (custom_ops registers torch ops, about a second) load on first
# use, so that `import kernelgen` then `kernelgen.custom_ops.sparse_attention(...)` works as written.
_LAZY_SUBMODULES = ("custom_ops", "distributed", "export", "integrations", "quality")


def __getattr__(name):
    if name in _LAZY_SUBMODULES:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'kernelgen' has no attribute {name!r}")
