"""Maintainers: compile kernelgen's Triton and Gluon kernels for a GPU arch on a machine without a GPU.

    echo '[{"spec": {...}, "n": 4096, "backward": true, "resources": true}]' | python tools/offline_compile.py sm_90

Triton is given a stand-in driver that names the target (the arch, warp size 32) and never launches:
every `kernel[grid](...)` that the backends' launchers (`RoleImpl.launch`) make compiles (ptxas included: a
kernel without a cubin is an error) through the real launch path, with the argument types the launchers
really pass, and returns. Each case runs the roles of a forward of its spec (`roles.forward_roles`: the
selection role, else the given lists' `lists`, then `attn` or `kv_attn`), then the backward's
(`roles.backward_roles`) where asked, each launched with the arguments its launch signature takes
(`_launch_args`) and built as dispatch does it (`SparseAttention._run`): by the backend that runs the role for
the spec (`backends.runner`), for the role's kernel spec, with a config that dispatch would serve on the arch
(`Backend.check_config`). Gluon kernels go the same way (kernelgen.backends.gluon.launch_attn builds its TMA
descriptors from the CPU tensors; they only need aligned data pointers). Reads a JSON list of cases on stdin;
prints one JSON object per case: {"case": i, "kernels": [[name, shared_bytes], ...]} or {"case": i, "error": "..."}.
A case: {"spec": Spec fields, "n": seq length} and, per role, that role's config fields under its name (e.g.
"attn": AttnConfig's, or GluonAttnConfig's for a spec of backend "gluon"; "select", "kv_attn", "bwd_dq"): pinned
(dispatch checks them), and compiled where the spec runs the role; a role without one gets the arch's default.
"backward": true, or a backward role's config, compiles the backward's kernels (bwd_delta, bwd_dq, bwd_dkdv)
too; a "decode" config, the decode role's (after the forward's: a call of one query, its selection where the spec
selects, else given lists; the index selector's over the cache's pages too); "rows": true, a prefill over a cache of per-row lengths (`attn_rows`, or
`kv_attn_rows` for per-query lists, then `attn_paged` or `kv_attn_paged` over the cache's pages, after the
forward, over its lists); "union": true, a per-query
spec's union design too (kv_attn_union after the forward, kv_bwd_union after the backward); "fp8_cache": a torch
fp8 dtype's name ("float8_e4m3fn", "float8_e5m2"), the calls over a cache (decode, "rows") read their K and V cache
in it, twice (a scale for every row, then [B, Hkv] scales), and new keys are written into it (append_kv, contiguous
and paged); "page_size": the keys a page of the paged calls' cache (default: kv_block), and with a "decode"
config a step over those pages too (its pooled selection and decode; a page that holds no whole blocks compiles
the kernels that read each key's page); "index": {"heads": Hi, "dim": Di,
"dtype": "float16" or "bfloat16"} gives the index selector its tensors. "resources": true adds, per kernel,
{"name", "registers", "spill_stores", "wgmma", "loop"} under "resources" (`ptxas -v` of its PTX, Triton's own
ptxas; wgmma: the warp-group products in its TTGIR; loop: its longest loop's instructions per iteration and
warp, by kind, from its SASS): what decides how many programs share an SM, and what a step issues. "ptx": true
adds, per kernel, {"role", "name", "sha256"} under "ptx": the role whose launch compiled it and the sha256 of
its PTX normalised (`ptx_digest`: no .loc/.file lines, // comments, debug labels or debug sections), so that two
trees' kernels compare equal where only line numbers or file names differ (tools/carry_winners.py; with
TRITON_DISABLE_LINE_INFO=1 Triton emits no line info in the first place).

`compile_offline` runs this script in subprocesses from another process (the tests, whose process runs the
interpreter, and tools/kv_bwd_sweep.py).
"""
import argparse
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"  # real compiles, before kernelgen's import picks the interpreter

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


def compile_offline(cases: list[dict], arch: str, processes: int = 1, timeout: float = 1200) -> list[dict]:
    """Run this script for `arch` on `cases` (its JSON case format) in up to `processes` parallel processes;
    its result per case, in order: {"kernels": [[name, shared_bytes], ...]} (and "resources", "ptx" where asked) or
    {"error": "..."}."""
    import kernelgen

    # the kernelgen the calling process imported, whatever the script's directory puts first on sys.path
    root = str(Path(kernelgen.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    chunks = [list(range(len(cases)))[i::processes] for i in range(max(1, min(processes, len(cases))))]
    results: list = [None] * len(cases)
    with contextlib.ExitStack() as stack:
        runs = []
        for chunk in chunks:  # output to files: a full pipe cannot stall a process
            stdin, stdout, stderr = (stack.enter_context(tempfile.TemporaryFile("w+")) for _ in range(3))
            stdin.write(json.dumps([cases[i] for i in chunk]))
            stdin.seek(0)
            proc = stack.enter_context(subprocess.Popen([sys.executable, __file__, arch], stdin=stdin,
                                                        stdout=stdout, stderr=stderr, text=True, env=env))
            runs.append((chunk, proc, stdout, stderr))
        try:
            for chunk, proc, stdout, stderr in runs:
                proc.wait(timeout)
                stdout.seek(0)
                stderr.seek(0)
                out, err = stdout.read(), stderr.read()
                if proc.returncode != 0:
                    raise RuntimeError(err[-3000:])
                lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
                if [r["case"] for r in lines] != list(range(len(chunk))):
                    raise RuntimeError(err[-3000:])
                for i, result in zip(chunk, lines):
                    results[i] = result
        finally:  # a failure or a timeout leaves no compile running
            for _, proc, _, _ in runs:
                if proc.poll() is None:
                    proc.kill()
    return results


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


compiled: list = []  # the current case's kernels: (name, Triton's compiled kernel)
_run = JITFunction.run


def _compile_only(self, *args, grid, warmup, **kwargs):
    kernel = _run(self, *args, grid=grid, warmup=True, **kwargs)
    if not kernel.asm.get("cubin"):
        raise RuntimeError(f"{self.fn.__name__}: no cubin (ptxas did not run)")
    compiled.append((self.fn.__name__, kernel))
    return kernel


# SASS opcodes by the pipe or kind of work they take, for `_loop_mix` (anything else counts as "int": integer,
# predicate and address arithmetic, moves)
_OPCODE_KINDS = {"HGMMA": "mma", "HMMA": "mma", "MUFU": "mufu",
                 **dict.fromkeys(("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "F2FP", "FCHK"), "fp32"),
                 **dict.fromkeys(("LDG", "LDGSTS", "LDGDEPBAR", "DEPBAR", "UTMALDG", "UBLKCP", "LDS", "LDSM", "STS",
                                  "STG", "LDC", "ULDC", "SYNCS", "ARRIVES", "FENCE", "MEMBAR"), "mem"),
                 **dict.fromkeys(("BAR", "BRA", "BSSY", "BSYNC", "WARPSYNC", "WARPGROUP", "NOP", "EXIT", "YIELD"), "ctl")}


def _loop_mix(sass: str) -> dict:
    """The kernel's longest loop in its SASS (Triton's `asm["sass"]`: labels, then a control code and an
    instruction per line): its instructions per iteration and warp, by kind (`_OPCODE_KINDS`)."""
    labels, ops = {}, []
    for line in sass.splitlines():
        label = re.match(r"^\s*(\w+):\s*$", line)
        if label:
            labels[label.group(1)] = len(ops)
        elif "\t" in line and line.split("\t", 1)[1].strip():
            ops.append(re.sub(r"^@!?U?P[T\d]+\s+", "", line.split("\t", 1)[1].strip().rstrip(";")))
    loops = [ops[labels[op.split()[-1]]:at + 1] for at, op in enumerate(ops)
             if op.startswith("BRA") and labels.get(op.split()[-1], at + 1) <= at]
    body = max(loops, key=len, default=[])
    mix = {"instructions": len(body), **dict.fromkeys(("mma", "mufu", "fp32", "int", "mem", "ctl"), 0)}
    for op in body:
        mix[_OPCODE_KINDS.get(op.split()[0].split(".")[0], "int")] += 1
    return mix


def _resources(name: str, kernel, capability: int) -> dict:
    """Registers and spill stores of a compiled kernel (`ptxas -v` of its PTX), its wgmma products, and the
    instruction mix of its longest loop (`_loop_mix`)."""
    from triton.backends.nvidia.compiler import get_ptxas

    arch = f"sm_{capability}a" if capability >= 90 else f"sm_{capability}"
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "kernel.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        info = subprocess.run([get_ptxas(capability).path, f"-arch={arch}", "-v", ptx, "-o",
                               os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True, check=True).stderr
    registers = re.search(r"Used (\d+) registers", info)
    spills = re.search(r"(\d+) bytes spill stores", info)
    return dict(name=name, registers=int(registers.group(1)) if registers else None,
                spill_stores=int(spills.group(1)) if spills else None,
                wgmma=kernel.asm.get("ttgir", "").count("warp_group_dot "), loop=_loop_mix(kernel.asm["sass"]))


# what PTX holds that is no instruction: line info and file names (`.loc`, `.file`, the debug labels it anchors to)
_PTX_DEBUG_LINE = re.compile(r"\s*\.(loc|file)\b|\s*\$L__(tmp|func_begin|func_end)\d+:\s*$")


def ptx_digest(ptx: str) -> str:
    """sha256 of a kernel's PTX without its line info, file names, comments and debug sections: equal for the
    same code compiled from a file whose lines moved or whose name changed."""
    kept = []
    for line in ptx.splitlines():
        if re.match(r"\s*\.section\s+\.debug", line):  # LLVM puts the debug sections after the code
            break
        line = line.split("//", 1)[0].rstrip()
        if line.strip() and not _PTX_DEBUG_LINE.match(line):
            kept.append(line)
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()


def _launch_args(role: str, t: dict, shapes) -> tuple:
    """The arguments of `role`'s launch after (kernel, spec, config, shapes) (kernelgen.roles' launch
    signatures), from the case's tensors `t` and what the roles before it returned."""
    from kernelgen.reverse_index import build_query_reverse_index, build_reverse_index

    q, k, v = t["q"], t["k"], t["v"]
    return {"lists": lambda: (t["given"],),
            "select": lambda: (q, k),
            "kv_select": lambda: (q, k),
            "decode_select": lambda: (q, k),
            "kv_decode_select": lambda: (q, k),
            "select_index": lambda: t["index"],
            "kv_select_index": lambda: t["index"],
            "decode_select_index": lambda: (*t["index"], t["seqlens"]),  # its kernels over a cache's rows
            "kv_decode_select_index": lambda: (*t["index"], t["seqlens"]),
            "attn": lambda: (q, k, v, t["lists"], None),
            "kv_attn": lambda: (q, k, v, t["lists"], None, None),  # its reverse index: built by the launcher
            "kv_attn_union": lambda: (q, k, v, t["lists"], None, None),  # its tile union: built by the launcher
            "decode": lambda: (q, k, v, t["lists"], None),
            "attn_rows": lambda: (q, k, v, t["lists"], None, t["seqlens"]),
            "kv_attn_rows": lambda: (q, k, v, t["lists"], None, None, t["seqlens"]),
            "attn_paged": lambda: (q, t["k_pages"], t["v_pages"], t["lists"], None, t["seqlens"], t["table"]),
            "kv_attn_paged": lambda: (q, t["k_pages"], t["v_pages"], t["lists"], None, None, t["seqlens"], None,
                                      t["table"]),
            "bwd_delta": lambda: (t["o"], t["o"]),
            "bwd_dq": lambda: (q, k, v, t["o"], t["lse"], t["delta"], t["lists"], None),
            "bwd_dkdv": lambda: (q, k, v, t["o"], t["lse"], t["delta"],
                                 build_reverse_index(t["lists"], shapes.n_kv_blocks), None),
            "kv_bwd": lambda: (q, k, v, t["o"], t["lse"], t["delta"], t["lists"],
                               build_query_reverse_index(t["lists"], shapes.n_kv_blocks), None),
            "kv_bwd_union": lambda: (q, k, v, t["o"], t["lse"], t["delta"], t["lists"], None, None)}[role]()


# what each role's launch returns, by name, for the roles after it
_RESULTS = {"lists": ("lists",), "select": ("lists",), "kv_select": ("lists",), "select_index": ("lists",),
            "kv_select_index": ("lists",), "decode_select": ("lists",), "kv_decode_select": ("lists",),
            "decode_select_index": ("lists",), "kv_decode_select_index": ("lists",),
            "attn": ("o", "lse"), "kv_attn": ("o", "lse"), "kv_attn_union": ("o", "lse"), "decode": ("o", "lse"),
            "attn_rows": ("o", "lse"), "kv_attn_rows": ("o", "lse"), "attn_paged": ("o", "lse"),
            "kv_attn_paged": ("o", "lse"),
            "bwd_delta": ("delta",), "bwd_dq": ("dq",), "bwd_dkdv": ("dk", "dv"), "kv_bwd": ("dq", "dk", "dv"),
            "kv_bwd_union": ("dq", "dk", "dv")}


# the roles that read a KV cache's values, which an fp8 cache's calls run with its scales
_CACHE_ROLES = ("decode", "attn_rows", "kv_attn_rows", "attn_paged", "kv_attn_paged")


def _fp8_cache(t: dict, dtype_name: str) -> dict:
    """The case's tensors with its K and V cache (contiguous and paged) in the fp8 dtype named."""
    dtype = getattr(torch, dtype_name)
    return {**t, **{name: t[name].to(dtype) for name in ("k", "v", "k_pages", "v_pages")}}


def _fp8_scales():
    """An fp8 cache's scales of each kind the kernels compile for: one for every row, then [B, Hkv] (B 1, Hkv 2)."""
    from kernelgen.inputs import KVScales

    return KVScales(torch.ones(1), torch.ones(1)), KVScales(torch.ones(1, 2), torch.ones(1, 2))


_EXPECTED = ("a JSON list of cases on stdin, e.g. echo '[{\"spec\": {\"head_dim\": 128, ...}, \"n\": 4096}]' | "
             "python tools/offline_compile.py sm_90 (--help: the case format)")


def _usage_error(message: str):
    """One line on stderr and exit status 2, as argparse's usage errors (a run by hand: no traceback)."""
    print(f"offline_compile.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def main(argv=None) -> None:
    """The command line: the arch, then the cases on stdin (`compile_cases`)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("arch", help="the CUDA arch to compile for, as the GPU reports it: sm_80, sm_90, ...")
    args = parser.parse_args(argv)
    from kernelgen.archs import check_arch
    from kernelgen.errors import KernelgenError

    if not re.fullmatch(r"sm_\d+", args.arch):  # check_arch's "cpu" too: the interpreter compiles nothing
        _usage_error(f"arch={args.arch!r}: expected a CUDA arch as the GPU reports it, sm_XY such as sm_80 or sm_90")
    try:
        arch = check_arch(args.arch)
    except KernelgenError as error:  # too old, or no compute capability
        _usage_error(str(error))
    if sys.stdin.isatty():  # nothing piped in: say what to pipe rather than wait for it
        _usage_error(f"expected {_EXPECTED}")
    text = sys.stdin.read()
    if not text.strip():
        _usage_error(f"stdin is empty; expected {_EXPECTED}")
    try:
        cases = json.loads(text)
    except json.JSONDecodeError as error:
        _usage_error(f"stdin is not JSON ({error}); expected {_EXPECTED}")
    if not isinstance(cases, list):
        _usage_error(f"stdin holds a JSON {type(cases).__name__}, not a list; expected {_EXPECTED}")
    if not all(isinstance(case, dict) for case in cases):
        _usage_error(f"stdin holds a list of other things than objects (cases); expected {_EXPECTED}")
    compile_cases(cases, arch)


def compile_cases(cases: list[dict], arch: str) -> None:
    """Compile each case for `arch` (sm_XY); a JSON line per case on stdout."""
    from kernelgen import Spec, backends, get_kernel
    from kernelgen.inputs import Shapes, check_block_idx, check_index
    from kernelgen.reference import scatter_pages
    from kernelgen.roles import (ROLES, WorkloadShape, backward_roles, forward_roles, get_role, index_inputs,
                             pinnable_roles)

    capability = int(arch.removeprefix("sm_"))
    driver.set_active(OfflineDriver(capability))
    JITFunction.run = _compile_only
    owners: list[str] = []  # the role of each kernel in `compiled`, in order

    def run(spec, role, config, shapes, *args, **options):
        """Build and launch `role` as dispatch does on `arch`: the backend that runs it, its kernel spec, a
        config feasible there (None: the arch's default)."""
        backend = backends.runner(spec.backend, role)
        kernel_spec = get_role(role).kernel_spec(spec, backend.name)
        if config is None and backend.role(role).config_type is not None:
            config = backend.default_config(kernel_spec, role, arch)
        backend.check_config(kernel_spec, role, config, arch)
        kernel = backend.build(kernel_spec, role, config)
        first = len(compiled)
        out = backend.role(role).launch(kernel, kernel_spec, config, shapes, *args, **options)
        owners.extend([role] * (len(compiled) - first))  # the kernels this launch compiled are the role's
        return out

    for i, case in enumerate(cases):
        compiled.clear()
        owners.clear()
        try:
            spec = Spec(**case["spec"])
            n, g = case["n"], spec.gqa_group
            # the roles a forward of the spec runs (`roles.forward_roles`: its selection, else the given
            # lists' normalisation, then attention), and the backward's where the case pins or asks for it
            lists_role, selection, attn_role = forward_roles(spec)
            roles = [selection or lists_role, attn_role]
            decode_selection = forward_roles(spec, 1)[1] if "decode" in case else None
            if case.get("rows"):  # a prefill over a cache of per-row lengths, over the forward's lists
                roles += [forward_roles(spec, cache_rows=True, paged=paged)[2] for paged in (False, True)]
            if case.get("union"):
                roles.append("kv_attn_union")
            if case.get("backward") or any(role in case for role in backward_roles(spec)):
                roles += backward_roles(spec) + (("kv_bwd_union",) if case.get("union") else ())
            configs = {role: backends.runner(spec.backend, role).config_from_dict(role, case[role])
                       for role in ROLES if role in case}
            # the spec and the configs of the roles its calls run pass dispatch's checks (a case may pin more: a
            # selection config beside a spec of given lists, compiled with a selector's spec)
            runs = pinnable_roles(spec)
            get_kernel(spec, configs={role: cfg for role, cfg in configs.items() if role in runs})
            shapes = Shapes(1, 2 * g, 2, n, n, spec.n_q_tiles(n), spec.n_kv_blocks(n))
            t = {"q": torch.randn(1, 2 * g, n, spec.head_dim, dtype=torch.bfloat16),
                 "seqlens": torch.full((1,), n, dtype=torch.int32)}
            t["k"], t["v"] = (torch.randn(1, 2, n, spec.head_dim, dtype=torch.bfloat16) for _ in range(2))
            page_size = case.get("page_size", spec.kv_block)  # a page a block unless the case says: only compiles
            pages = torch.arange(-(-shapes.n_kv_blocks * spec.kv_block // page_size))
            room = (0, 0, 0, len(pages) * page_size - n)
            t["k_pages"], t["v_pages"] = (scatter_pages(torch.nn.functional.pad(x, room), page_size, pages)
                                          for x in (t["k"], t["v"]))
            t["table"] = pages.view(1, -1).to(torch.int32)
            if selection is None:
                given = torch.zeros(1, 2, shapes.n_q_tiles, spec.top_k, dtype=torch.int32)
                t["given"] = check_block_idx(given, spec, shapes, torch.device("cpu"))
            if "index" in case:  # {"heads": Hi, "dim": Di, "dtype": torch dtype's name}
                dtype = getattr(torch, case["index"]["dtype"])
                t["index"] = index_inputs(spec, WorkloadShape(1, 2, n, n), "cpu", dtype, case["index"]["heads"],
                                          case["index"]["dim"])
                # dispatch's checks (the CPU refuses bfloat16 index tensors: those of the interpreter's calls)
                check_index(tuple(x.half() if x.dtype == torch.bfloat16 else x for x in t["index"]), spec, shapes,
                            torch.device("cpu"))
            fp8 = case.get("fp8_cache")
            for role in roles:
                out = run(spec, role, configs.get(role), shapes, *_launch_args(role, t, shapes))
                t.update(zip(_RESULTS[role], out if isinstance(out, tuple) else (out,)))
                if role in (lists_role, selection):  # never launched: any ids, only compiles
                    t["lists"] = t["lists"].clamp(-1, shapes.n_kv_blocks - 1)
                if fp8 and role in _CACHE_ROLES:  # again over the fp8 cache
                    for scales in _fp8_scales():
                        run(spec, role, configs.get(role), shapes, *_launch_args(role, _fp8_cache(t, fp8), shapes),
                            kv_scales=scales)
            if "decode" in case:  # a call of one query: its selection where the spec selects (else given lists)
                one = shapes._replace(n_q=1, n_q_tiles=spec.n_q_tiles(1))
                t = {**t, "q": t["q"][:, :, -1:],
                     "lists": torch.zeros(1, 2, one.n_q_tiles, spec.top_k, dtype=torch.int32)}
                if "index" in t:  # the last query's index vectors
                    t["index"] = (t["index"][0][:, :, -1:], t["index"][1], t["index"][2][:, :, -1:])
                for role in [decode_selection, "decode"] if decode_selection else ["decode"]:
                    out = run(spec, role, configs.get(role), one, *_launch_args(role, t, one))
                    t.update(zip(_RESULTS[role], out if isinstance(out, tuple) else (out,)))
                    t["lists"] = t["lists"].clamp(-1, one.n_kv_blocks - 1)
                if "page_size" in case:  # a step over the cache's pages: its selection (pooled there) and decode
                    paged = dict(seqlens=t["seqlens"], block_table=t["table"])
                    if decode_selection in ("decode_select", "kv_decode_select"):
                        run(spec, decode_selection, configs.get(decode_selection), one, t["q"], t["k_pages"], **paged)
                    run(spec, "decode", configs.get("decode"), one, t["q"], t["k_pages"], t["v_pages"], t["lists"],
                        None, **paged)
                for scales in _fp8_scales() if fp8 else ():  # a step over the fp8 cache
                    run(spec, "decode", configs.get("decode"), one, *_launch_args("decode", _fp8_cache(t, fp8), one),
                        kv_scales=scales)
                if spec.window is not None and spec.selector != "given":  # a step that makes its window's lists
                    run(spec, "decode", configs.get("decode"), one, t["q"], t["k"], t["v"], None, None)
                if "index" in t:  # and over the cache's pages: k_idx paged as k is
                    q_idx, k_idx, w = t["index"]
                    k_idx_pages = scatter_pages(torch.nn.functional.pad(k_idx, room), page_size, pages)
                    run(spec, decode_selection, configs.get(decode_selection), one, q_idx, k_idx_pages, w,
                        t["seqlens"], None, t["table"])
            if fp8:  # new keys written into the fp8 cache, quantised: contiguous, then paged
                cache = _fp8_cache(t, fp8)
                new = t["k"][:, :, :3]
                for scales in _fp8_scales():
                    run(spec, "append_kv", None, shapes, cache["k"], new, cache["v"], new, seqlens=t["seqlens"],
                        kv_scales=scales)
                    run(spec, "append_kv", None, shapes, cache["k_pages"], new, cache["v_pages"], new,
                        seqlens=t["seqlens"], block_table=t["table"], kv_scales=scales)
            result = {"case": i, "kernels": [[name, kernel.metadata.shared] for name, kernel in compiled]}
            if case.get("resources"):
                result["resources"] = [_resources(name, kernel, capability) for name, kernel in compiled]
            if case.get("ptx"):
                result["ptx"] = [dict(role=role, name=name, sha256=ptx_digest(kernel.asm["ptx"]))
                                 for role, (name, kernel) in zip(owners, compiled)]
            print(json.dumps(result), flush=True)
        except Exception as error:  # report per case; the test names it
            print(json.dumps({"case": i, "error": "".join(traceback.format_exception_only(error))[-2000:]}),
                  flush=True)


if __name__ == "__main__":
    main()
