"""Compile kernelgen's Triton and Gluon kernels for sm_90 on a machine without a GPU (run as a script).

Triton is given a stand-in driver that names the target (sm_90, warp size 32) and never launches:
every `kernel[grid](...)` that ops.py makes compiles (ptxas included: a kernel without a cubin is an
error) through the real launch path, with the argument types ops.py really passes, and returns. Gluon
kernels go the same way (ops.attention_gluon builds its TMA descriptors from the CPU tensors; they only
need aligned data pointers). Reads a JSON list of cases on stdin; prints one JSON object per case:
{"case": i, "kernels": [[name, shared_bytes], ...]} or {"case": i, "error": "..."}.
A case: {"spec": Spec fields, "attn": the attention config's fields (AttnConfig, or GluonAttnConfig for a
spec of backend "gluon"), "select": SelectConfig fields, "n": seq length}.
"""
import json
import os
import sys
import traceback

os.environ["TRITON_INTERPRET"] = "0"  # real compiles (the test process runs the interpreter)

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class OfflineDriver:
    """Just enough of Triton's CUDA driver to compile for sm_90: a target, a device id, no stream."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


compiled: list = []
_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    if not kernel.asm.get("cubin"):
        raise RuntimeError(f"{self.fn.__name__}: no cubin (ptxas did not run)")
    compiled.append([self.fn.__name__, kernel.metadata.shared])
    return kernel


def main() -> None:
    driver.set_active(OfflineDriver())
    JITFunction.run = _compile_only
    from kernelgen import SelectConfig, Spec, get_kernel, ops
    from kernelgen.config import config_from_dict

    for i, case in enumerate(json.load(sys.stdin)):
        compiled.clear()
        try:
            spec = Spec(**case["spec"])
            n, g = case["n"], spec.gqa_group
            q = torch.randn(1, 2 * g, n, spec.head_dim, dtype=torch.bfloat16)
            k, v = torch.randn(1, 2, n, spec.head_dim, dtype=torch.bfloat16), torch.randn(1, 2, n, spec.head_dim,
                                                                                           dtype=torch.bfloat16)
            attn_cfg, select_cfg = config_from_dict("attn", case["attn"], spec.backend), SelectConfig(**case["select"])
            attn = get_kernel(spec, configs={"attn": attn_cfg, "select": select_cfg})
            shapes = ops.Shapes(1, 2 * g, 2, n, n, spec.n_q_tiles(n), spec.n_kv_blocks(n))
            select_mod = attn.module("select", select_cfg)
            if spec.selects:
                idx = ops.select(q, k, spec, shapes, select_mod, select_cfg)
            else:
                idx = torch.zeros(1, 2, shapes.n_q_tiles, spec.top_k, dtype=torch.int32)
                idx = ops.prepare_block_idx(idx, spec, shapes, q.device, select_mod)
            attention = ops.attention_gluon if spec.backend == "gluon" else ops.attention
            attention(q, k, v, idx, spec, shapes, attn.module("attn", attn_cfg), attn_cfg, None)
            print(json.dumps({"case": i, "kernels": compiled}), flush=True)
        except Exception as error:  # report per case; the test names it
            print(json.dumps({"case": i, "error": "".join(traceback.format_exception_only(error))[-2000:]}),
                  flush=True)


if __name__ == "__main__":
    main()
