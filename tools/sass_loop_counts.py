"""Instruction mix of the Gluon forward's KV loop, from its sm_90 SASS, on a machine without a GPU.

    python tools/sass_loop_counts.py [--block-m 64] [--stages 3] [--spec JSON] [--sass FILE]

Compiles the Gluon forward of a spec (default: benchmark shape (a)'s, given lists) for sm_90 through
ops.attention_gluon's real launch path (tests/sm90_offline.py's stand-in driver), disassembles it with
the cuobjdump Triton ships, and prints registers, shared memory, and the opcode counts of each path
through the hot loop: the loop is the conditional backward branch's span that holds the most HGMMA; its paths are
the two sides of the first forward branch inside it (the unmasked and the elementwise-masked softmax).
Counts are per warp and per loop step (one listed block).
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import sm90_offline  # noqa: E402

LINE = re.compile(r"/\*(?P<addr>[0-9a-f]{4,})\*/\s+(?P<ins>[^;]*);")


def compile_gluon(spec, block_m: int, stages: int):
    """The compiled Gluon forward (Triton CompiledKernel) of `spec` with one config, compiled offline."""
    from kernelgen import get_kernel, ops
    from kernelgen.config import GluonAttnConfig, default_config

    kernels = {}

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernels[self.fn.__name__] = sm90_offline._run(self, *args, grid=grid, warmup=True, **kwargs)
        return kernels[self.fn.__name__]

    driver.set_active(sm90_offline.OfflineDriver())
    JITFunction.run = compile_only
    cfg = GluonAttnConfig(block_m=block_m, num_stages=stages)
    select_cfg = default_config(spec.replace(selector="mean", backend="triton"), "select")
    attn = get_kernel(spec, configs={"attn": cfg, "select": select_cfg})
    n, g = 4096, spec.gqa_group
    q = torch.randn(1, 2 * g, n, spec.head_dim, dtype=torch.bfloat16)
    k = torch.randn(1, 2, n, spec.head_dim, dtype=torch.bfloat16)
    shapes = ops.Shapes(1, 2 * g, 2, n, n, spec.n_q_tiles(n), spec.n_kv_blocks(n))
    idx = torch.zeros(1, 2, shapes.n_q_tiles, spec.top_k, dtype=torch.int32)
    idx = ops.prepare_block_idx(idx, spec, shapes, q.device, attn.module("select", select_cfg))
    ops.attention_gluon(q, k, k, idx, spec, shapes, attn.module("attn", cfg), cfg, None)
    return kernels["attn_fwd"]


def cuobjdump(cubin: bytes, *flags: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *flags, f.name], check=True, capture_output=True, text=True).stdout


def parse(sass: str) -> tuple[list[str], dict[int, int]]:
    """Instructions in order, and each one's index by address."""
    instructions, at = [], {}
    for line in sass.splitlines():
        if m := LINE.search(line):
            at[int(m.group("addr"), 16)] = len(instructions)
            instructions.append(m.group("ins").strip())
    return instructions, at


def branch_target(ins: str, at: dict[int, int]) -> int | None:
    """The index a branch instruction jumps to (None for anything else)."""
    m = re.match(r"(@!?U?P\w+\s+)?BRA\s+(0x[0-9a-f]+)", ins)
    return at.get(int(m.group(2), 16)) if m else None


def opcode(ins: str) -> str:
    op = ins.split()[1] if ins.startswith("@") else ins.split()[0]
    return op.split(".")[0]


def loop_paths(instructions: list[str], at: dict[int, int]) -> dict[str, list[str]]:
    # a loop ends in a conditional backward branch (an unconditional one returns from out-of-line code)
    loops = [(t, i) for i, ins in enumerate(instructions)
             if ins.startswith("@") and (t := branch_target(ins, at)) is not None and t <= i]
    if not loops:
        raise SystemExit("no backward branch: no loop found")
    start, end = max(loops, key=lambda se: (sum("HGMMA" in x for x in instructions[se[0]:se[1] + 1]), se[0] - se[1]))
    body = range(start, end + 1)
    for i in body:
        t = branch_target(instructions[i], at)
        if t is None or not instructions[i].startswith("@") or not i < t <= end:
            continue
        skipped = range(i + 1, t)  # the fall-through side, up to the target; it ends jumping over the other
        join = branch_target(instructions[t - 1], at)
        taken = range(t, join) if join is not None and t < join <= end else range(0)
        return {"taken": [instructions[j] for j in body if j not in skipped],
                "fall-through": [instructions[j] for j in body if j not in taken]}
    return {"loop": [instructions[j] for j in body]}


def main():
    from kernelgen import Spec

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spec", default=None, help="Spec fields as JSON (default: shape (a), given lists, Gluon)")
    p.add_argument("--block-m", type=int, default=64)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--sass", default=None, help="also write the whole SASS here")
    args = p.parse_args()
    fields = json.loads(args.spec) if args.spec else dict(head_dim=64, kv_block=64, q_tile=64, top_k=16,
                                                           causal=False, gqa_group=1, selector="given")
    spec = Spec(**{**fields, "backend": "gluon"})
    kernel = compile_gluon(spec, args.block_m, args.stages)
    sass = cuobjdump(kernel.asm["cubin"], "-sass")
    if args.sass:
        with open(args.sass, "w") as f:
            f.write(sass)
    usage = re.search(r"REG:(\d+)", cuobjdump(kernel.asm["cubin"], "--dump-resource-usage"))
    print(f"spec {spec.key()} block_m {args.block_m} stages {args.stages}: registers {usage.group(1)}, "
          f"dynamic shared memory {kernel.metadata.shared} B")
    for path, ins in loop_paths(*parse(sass)).items():
        counts = collections.Counter(opcode(x) for x in ins)
        print(f"loop, {path} side: {len(ins)} instructions per warp and step: "
              + ", ".join(f"{op} {n}" for op, n in counts.most_common()))


if __name__ == "__main__":
    main()
