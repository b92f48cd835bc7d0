"""Compile kernelgen's Triton and Gluon kernels for a GPU arch on a machine without a GPU (run as a script:
`python tests/offline_compile.py sm_89`).

Triton is given a stand-in driver that names the target (the arch, warp size 32) and never launches:
every `kernel[grid](...)` that the backends' launchers (`RoleImpl.launch`: kernelgen.backends.triton's
launch_select, launch_lists, launch_attn) make compiles (ptxas included: a kernel without a cubin is an
error) through the real launch path, with the argument types the launchers really pass, and returns.
Each role's kernel is built and launched as dispatch does it (`SparseAttention._run`): by the backend
that runs the role for the spec (`backends.runner`), for the role's kernel spec, with a config that
dispatch would serve on the arch (`Backend.check_config`). Gluon kernels go the
same way (kernelgen.backends.gluon.launch_attn builds its TMA descriptors from the CPU tensors; they
only need aligned data pointers). Reads a JSON list of cases on stdin; prints one JSON object per case:
{"case": i, "kernels": [[name, shared_bytes], ...]} or {"case": i, "error": "..."}.
A case: {"spec": Spec fields, "attn": the attention config's fields (AttnConfig, or GluonAttnConfig for a
spec of backend "gluon"), "select": SelectConfig fields, "n": seq length}, and optionally "bwd_dq" and
"bwd_dkdv": those roles' config fields, to compile the backward's kernels (bwd_delta, bwd_dq, bwd_dkdv) too.
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
    """Just enough of Triton's CUDA driver to compile for one arch: a target, a device id, no stream."""

    def __init__(self, capability: int):
        self.capability = capability

    def get_current_target(self):
        return GPUTarget("cuda", self.capability, 32)

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


def main(arch: str) -> None:
    from kernelgen import Spec, backends, get_kernel
    from kernelgen.archs import check_arch
    from kernelgen.inputs import Shapes, check_block_idx
    from kernelgen.roles import get_role

    driver.set_active(OfflineDriver(int(check_arch(arch).removeprefix("sm_"))))
    JITFunction.run = _compile_only

    def run(spec, role, config, shapes, *args):
        """Build and launch `role` as dispatch does on `arch`: the backend that runs it, its kernel spec, a
        config feasible there."""
        backend = backends.runner(spec.backend, role)
        kernel_spec = get_role(role).kernel_spec(spec, backend.name)
        backend.check_config(kernel_spec, role, config, arch)
        kernel = backend.build(kernel_spec, role, config)
        return backend.role(role).launch(kernel, kernel_spec, config, shapes, *args)

    for i, case in enumerate(json.load(sys.stdin)):
        compiled.clear()
        try:
            spec = Spec(**case["spec"])
            n, g = case["n"], spec.gqa_group
            q = torch.randn(1, 2 * g, n, spec.head_dim, dtype=torch.bfloat16)
            k, v = torch.randn(1, 2, n, spec.head_dim, dtype=torch.bfloat16), torch.randn(1, 2, n, spec.head_dim,
                                                                                           dtype=torch.bfloat16)
            configs = {"attn": backends.runner(spec.backend, "attn").config_from_dict("attn", case["attn"]),
                       "select": backends.runner(spec.backend, "select").config_from_dict("select", case["select"])}
            get_kernel(spec, configs=configs)  # the spec and the pinned configs pass dispatch's checks
            shapes = Shapes(1, 2 * g, 2, n, n, spec.n_q_tiles(n), spec.n_kv_blocks(n))
            if spec.selects:
                idx = run(spec, "select", configs["select"], shapes, q, k)
            else:
                idx = torch.zeros(1, 2, shapes.n_q_tiles, spec.top_k, dtype=torch.int32)
                idx = check_block_idx(idx, spec, shapes, q.device)
                lists = backends.runner(spec.backend, "lists")
                idx = run(spec, "lists", lists.default_config(get_role("lists").kernel_spec(spec, lists.name), "lists",
                                                              arch), shapes, idx)
            o, lse = run(spec, "attn", configs["attn"], shapes, q, k, v, idx, None)
            if "bwd_dq" in case:
                from kernelgen.reverse_index import build_reverse_index

                bwd = {role: backends.runner(spec.backend, role).config_from_dict(role, case[role])
                       for role in ("bwd_dq", "bwd_dkdv")}
                get_kernel(spec, configs=bwd)
                idx = idx.clamp(-1, shapes.n_kv_blocks - 1)  # never launched: whatever ids, only compiles
                delta = run(spec, "bwd_delta", None, shapes, o, o)
                run(spec, "bwd_dq", bwd["bwd_dq"], shapes, q, k, v, o, lse, delta, idx, None)
                run(spec, "bwd_dkdv", bwd["bwd_dkdv"], shapes, q, k, v, o, lse, delta,
                    build_reverse_index(idx, shapes.n_kv_blocks), None)
            print(json.dumps({"case": i, "kernels": compiled}), flush=True)
        except Exception as error:  # report per case; the test names it
            print(json.dumps({"case": i, "error": "".join(traceback.format_exception_only(error))[-2000:]}),
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
