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

from . import backends, reference  # noqa: E402
from .backends.gluon import GluonAttnConfig  # noqa: E402
from .backends.tilelang import TileLangAttnConfig, TileLangBwdDkdvConfig  # noqa: E402
from .backends.triton import (AttnConfig, BwdDkdvConfig, BwdDqConfig, DecodeConfig, IndexSelectConfig,  # noqa: E402
                                KvAttnConfig, KvBwdConfig, KvIndexSelectConfig, KvSelectConfig, KvUnionBwdConfig,
                                KvUnionConfig, SelectConfig)
from .dispatch import SparseAttention, get_kernel  # noqa: E402
from .errors import (KernelgenError, KernelgenNotImplementedError, KernelgenRuntimeError, KernelgenTypeError,  # noqa: E402
                     KernelgenValueError)
from .inputs import BlockLists, KeyReps  # noqa: E402
from .interop import from_block_mask, to_block_mask  # noqa: E402
from .reverse_index import ReverseIndex, build_reverse_index  # noqa: E402
from .spec import Spec  # noqa: E402

__all__ = ["Spec", "get_kernel", "SparseAttention", "BlockLists", "KeyReps", "ReverseIndex", "build_reverse_index",
           "AttnConfig",
           "SelectConfig", "IndexSelectConfig", "BwdDqConfig", "BwdDkdvConfig", "KvSelectConfig", "KvAttnConfig",
           "KvUnionConfig", "KvUnionBwdConfig", "KvBwdConfig", "KvIndexSelectConfig", "DecodeConfig",
           "TileLangAttnConfig", "TileLangBwdDkdvConfig", "GluonAttnConfig",
           "KernelgenError", "KernelgenValueError", "KernelgenTypeError",
           "KernelgenRuntimeError", "KernelgenNotImplementedError", "backends", "reference", "from_block_mask",
           "to_block_mask"]
__version__ = "0.1.0"
