"""Why a call with prepared lists (attn.prepare) can time slower under do_bench than one that
normalises its lists each call (session 9, a32k: 0.195 against 0.178 ms, while their CUDA-graph
replays agree). do_bench clears L2 before every call; a normalising call writes the lists it then
reads, so they are in L2, while prepared lists are read cold. Rows (do_bench median, graph replay):

  given        auto(q, k, v, block_idx=idx): normalise + attention
  prepared     auto(q, k, v, block_idx=lists)
  prepared+touch   the same after a copy of the prepared lists into a scratch tensor (brings them into L2)
  touch        that copy alone
  prepared+alloc   the same with an allocation of the lists' size alive during the call (a normalising
                   call allocates its lists before the output: the output's address then differs)

    python3 tools/prepared_probe.py [--shapes a32k,b]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import kernelgen  # noqa: E402
from kernelgen.bench import SHAPES, _bench, _bench_graph  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="a32k,b")
    args = p.parse_args()
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        q, k, v = shape.inputs("cuda", torch.bfloat16)
        idx = kernelgen.get_kernel(shape.spec("mean")).select(q, k)
        auto = kernelgen.get_kernel(shape.spec("given").replace(backend="auto"))
        lists = auto.prepare(idx, shape.n_q, shape.n_k)
        scratch = torch.empty_like(lists.block_idx)
        touch = lambda: scratch.copy_(lists.block_idx)  # noqa: E731
        rows = {"given": lambda: auto(q, k, v, block_idx=idx),
                "prepared": lambda: auto(q, k, v, block_idx=lists),
                "prepared+touch": lambda: (touch(), auto(q, k, v, block_idx=lists)),
                "touch": touch,
                "prepared+alloc": lambda: (torch.empty_like(lists.block_idx), auto(q, k, v, block_idx=lists))}
        assert torch.equal(rows["given"](), rows["prepared"]())
        rows = dict(rows, **{"given ": rows["given"], "prepared ": rows["prepared"]})  # again, after the others
        for label, fn in rows.items():
            print(f"{name:6s} {auto.backend(shape.n_k):8s} {label:16s} {_bench(fn):7.3f} ms (graph {_bench_graph(fn):7.3f})",
                  flush=True)


if __name__ == "__main__":
    main()
