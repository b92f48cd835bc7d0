"""Context parallelism: sparse attention over a sequence sharded across the ranks of a torch.distributed group.

    import kernelgen.distributed as kd
    q_s, k_s, v_s = (kd.shard(x, "zigzag") for x in (q, k, v))     # or shards made by the model
    o_s = kd.attention(q_s, k_s, v_s, spec, block_idx=lists)       # lists: global block ids, as on one GPU
    o = kd.unshard(o_s, "zigzag")

Layouts (`layout.py`), the dense ring (`ring.py`), the sparse fetch (`fetch.py`), selection across shards
(`select.py`), the entry point with its autograd Function (`attention.py`), and every rank's pieces run in one
process (`simulate.py`: to check and time a rank's work on one device); docs/DESIGN.md explains them.
"""
from .attention import PATHS, Traffic, attention, select_blocks, shard, traffic, unshard
from .layout import LAYOUTS, Layout

__all__ = ["attention", "select_blocks", "shard", "unshard", "traffic", "Traffic", "Layout", "LAYOUTS", "PATHS"]
