"""Maintainers: keep tuning winners across a template edit that leaves their compiled code unchanged.

    python tools/carry_winners.py OLD_REV [--db tuning_db/winners.db] [--dry-run] [--jobs N]

A winners row holds the hash of its role's template (`Backend.template_hash`): any edit of that template (a
comment, a rename, a feature flag that defaults off) makes the row a miss, and tests/test_lookup.py asks for a
re-tune on a GPU. Where the edit leaves the row's kernels compiling to the same code, the row's timing still holds;
this tool checks that on the CPU and re-stamps the row with the current hash instead.

The current tree is the working tree this file lives in, uncommitted edits included (run it before or after
committing the template edit), found from the file's own path, not from the working directory. OLD_REV is a
revision of that repository, checked out beside it (`git worktree add --detach` in a temporary directory, removed
afterwards; the repository's index and branch are untouched). For each row of the DB (default: this tree's
tuning_db/winners.db) whose template hash is not the current tree's:
  - a Triton or Gluon row whose hash is OLD_REV's is compiled in both trees for its arch, with its config pinned
    for its role, its spec (`spec_json`: the role's kernel spec) and its bucket as the sequence length, by
    tools/offline_compile.py (the real launchers, a stand-in driver: no GPU). Each tree's kernelgen and templates
    are imported from that tree (PYTHONPATH; checked), each compile process starts from empty Triton, kernelgen
    and TileLang caches, and Triton emits no line info (TRITON_DISABLE_LINE_INFO=1). The kernels that the role's
    launches compile are compared by their PTX (`offline_compile.ptx_digest`: no line info, file names or
    comments). The same PTX for every kernel of the role: "carried", and the row's template_hash becomes the
    current one (unless --dry-run). Else "differs: <kernels>" or "error: ...", and the row is left as it is;
  - a TileLang row (roles attn and bwd_dkdv) whose hash is OLD_REV's is lowered to CUDA C source in both trees
    (`kernelgen.backends.tilelang.lower`: TVM only, no nvcc, no GPU), each by that tree's kernelgen, templates
    and backends/tilelang.py (the same processes, environment and checks as above; this file's worker lowers):
    the row's spec and config (`Backend.check_config` on its arch first, as dispatch), batch 1, 2 KV heads (as
    tools/offline_compile.py's cases), its bucket as seq_q and seq_k, for its arch, with the build options
    dispatch gives the role (`attn_pass_configs`, `bwd_dkdv_pass_configs`). The sha256 of the two sources is
    compared as it is: the source holds no path, module name or line number of its tree (checked with TileLang
    0.1.15: two checkouts of one commit, and a template whose lines moved, lower to the same text), but it names
    the template's buffers and locals, so a renamed one differs. The same source: "carried" (re-stamped unless
    --dry-run); else "differs: <kernel>" (its __global__ function) or "error: ..." (OLD_REV's kernelgen may lack
    the functions called), and the row is left;
  - a row of another hash than OLD_REV's: "not from OLD_REV", left;
  - a role that tools/offline_compile.py has no case for (TileLang: a role other than attn and bwd_dkdv), a
    backend of neither kind, or a dtype other than bfloat16 (the one compiled and lowered): "not checked (...)",
    left.
It prints a line per such row (backend, role, arch, bucket, spec_key[:8], verdict); rows of the current hash are
not listed. Only the carried rows' template_hash is written, in one transaction: every other column and row, and
the DB's journal mode (the bundled DB's rollback journal), stay as they were. Exit status 0 whatever the
verdicts; 2 (one line on stderr) for an OLD_REV that is no commit or a DB that is no winners DB; 1 where nothing
can be checked (the current tree's kernelgen does not import, OLD_REV cannot be checked out).

What it guarantees: a Triton or Gluon row is re-stamped only when every kernel of its role compiles to the same
PTX in both trees, at the row's arch, config, spec and bucket, with the Triton installed here; a TileLang row only
when its kernel lowers to the same CUDA source in both trees, at the row's arch, config, spec and bucket (bf16,
batch 1, 2 KV heads), with the TileLang installed here (nvcc does not run: the same source gives the same cubin
with the same nvcc). What it does not check: other specialisations of the same kernels (a Triton length that is no
multiple of 16 compiles apart, a TileLang kernel is built per problem shape: other batches, head counts and
lengths, and the row also serves its bucket's neighbours); other dtypes. OLD_REV's own tools/offline_compile.py
compiles OLD_REV's kernels; where it predates the "ptx" option, this tree's script runs against OLD_REV's
kernelgen and templates instead (the output says so).
"""
import argparse
import contextlib
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent  # the current tree: the one holding this file
SCRIPT = Path("tools") / "offline_compile.py"
TABLE = "winners"
COLUMNS = ("spec_key", "role", "backend", "arch", "bucket", "dtype", "config", "template_hash", "spec_json")
CHECKED = ("triton", "gluon")  # the backends tools/offline_compile.py compiles
LOWERED = {"tilelang": ("attn", "bwd_dkdv")}  # the backends this file's worker lowers to CUDA source, their roles
DTYPE = "bfloat16"  # the dtype of tools/offline_compile.py's tensors, and of the lowered TileLang kernels
HEADS_KV = 2  # the KV heads of a lowered TileLang kernel: tools/offline_compile.py's cases' (batch 1)
TIMEOUT = 3600  # seconds a compile process may take (a few hundred kernels at most)

# the index selector's tensors, as the tuner times it (kernelgen.roles.INDEX_HEADS, INDEX_DIM)
_INDEX = {"index": {"heads": 4, "dim": 64, "dtype": DTYPE}}
# per role, the case options of tools/offline_compile.py that make a case compile it (its docstring); the row's
# config is pinned under the role's name beside them (a "decode" config asks for a decode call)
_OPTIONS = {
    **dict.fromkeys(("lists", "select", "kv_select", "attn", "kv_attn", "decode"), {}),
    **dict.fromkeys(("select_index", "kv_select_index"), _INDEX),
    "kv_attn_union": {"union": True},
    **dict.fromkeys(("bwd_delta", "bwd_dq", "bwd_dkdv", "kv_bwd"), {"backward": True}),
    "kv_bwd_union": {"union": True, "backward": True},
    **dict.fromkeys(("attn_rows", "kv_attn_rows", "attn_paged", "kv_attn_paged"), {"rows": True}),
    **dict.fromkeys(("decode_select", "kv_decode_select"), {"decode": None}),  # decode at its default fields
    **dict.fromkeys(("decode_select_index", "kv_decode_select_index"), {"decode": None, **_INDEX}),
}


class UsageError(Exception):
    """A bad OLD_REV or DB: one line on stderr, exit status 2."""


class WorkerError(Exception):
    """A tree that cannot be checked at all: a worker process that failed as a whole (not one case), a checkout
    that failed."""


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        return _worker()
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old_rev", metavar="OLD_REV", help="the revision whose templates the stale rows were tuned "
                                                           "with (a commit, branch, tag, HEAD~1, ...)")
    parser.add_argument("--db", type=Path, default=ROOT / "tuning_db" / "winners.db",
                        help="the winners DB to update (default: this tree's tuning_db/winners.db)")
    parser.add_argument("--dry-run", action="store_true", help="report only; write nothing")
    parser.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2),
                        help="compile processes per tree (default: half the CPUs)")
    args = parser.parse_args(argv)
    try:
        old_commit = _commit(args.old_rev)
        key, rows = _read_rows(args.db)
    except UsageError as error:
        print(f"carry_winners.py: error: {error}", file=sys.stderr)
        return 2
    print(f"current tree {ROOT}; OLD_REV {args.old_rev} = {old_commit[:12]}; DB {args.db}")
    try:
        verdicts, carried = carry(rows, old_commit, max(1, args.jobs))
    except WorkerError as error:  # the current tree's kernelgen does not import, or OLD_REV cannot be checked out
        print(f"carry_winners.py: error: {error}", file=sys.stderr)
        return 1
    for row, verdict in zip(rows, verdicts):
        if verdict is not None:
            print(f"{row['backend']:<8} {row['role']:<22} {row['arch']:<6} {row['bucket']:>7} {row['spec_key'][:8]}  "
                  f"{verdict}")
    stale = sum(v is not None for v in verdicts)
    if not stale:
        print("nothing to carry: every row's template hash is the current tree's")
    elif carried and not args.dry_run:
        _restamp(args.db, key, carried)
        print(f"{len(carried)} of {stale} stale rows carried: their template_hash re-stamped in {args.db}")
    else:
        print(f"{len(carried)} of {stale} stale rows carried; {args.db} not written"
              + (" (dry run)" if args.dry_run else ""))
    return 0


def _commit(rev: str) -> str:
    """OLD_REV's commit id, or a UsageError."""
    proc = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                          capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout.strip():
        raise UsageError(f"OLD_REV {rev!r} is no commit of the repository at {ROOT}")
    return proc.stdout.strip()


def _read_rows(db: Path) -> tuple[tuple[str, ...], list[dict]]:
    """(the table's key columns, its rows as dicts in key order); read-only: nothing is written, not even its
    journal mode."""
    if not db.is_file():
        raise UsageError(f"no DB file at {db}")
    try:
        with contextlib.closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True)) as conn:
            info = conn.execute(f"PRAGMA table_info({TABLE})").fetchall()  # (cid, name, type, notnull, dflt, pk)
            names = {column[1] for column in info}
            key = tuple(column[1] for column in sorted((c for c in info if c[5]), key=lambda c: c[5]))
            if not key or not names.issuperset(COLUMNS):
                raise UsageError(f"{db} is no winners DB: no table {TABLE!r} with a key and columns "
                                 f"{', '.join(COLUMNS)}")
            conn.row_factory = sqlite3.Row
            rows = [dict(row) for row in conn.execute(
                f"SELECT * FROM {TABLE} ORDER BY {', '.join(_quote(c) for c in key)}")]
    except sqlite3.DatabaseError as error:
        raise UsageError(f"{db} is no readable SQLite DB ({error})") from None
    return key, rows


def _quote(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def carry(rows: list[dict], old_commit: str, jobs: int) -> tuple[list, list]:
    """(a verdict per row, None for a row of the current template; [(row, current hash)] of the carried rows)."""
    try:
        current, _ = _tree_run(ROOT, sorted({_pair(row) for row in rows}))  # its template hashes only
    except WorkerError as error:
        raise WorkerError(f"current tree: {error}") from None
    verdicts: list = [None] * len(rows)
    groups: dict[tuple, list[int]] = {}  # rows to compile by case: rows of several GPUs share one
    for i, row in enumerate(rows):
        if _pair(row) in current["hash_errors"]:
            verdicts[i] = f"error: current tree: {current['hash_errors'][_pair(row)]}"
        elif row["template_hash"] == current["hashes"][_pair(row)]:
            continue
        elif row["backend"] not in CHECKED and row["backend"] not in LOWERED:
            verdicts[i] = f"not checked ({row['backend']})"
        elif row["backend"] in LOWERED and row["role"] not in LOWERED[row["backend"]]:
            verdicts[i] = f"not checked (role: only {', '.join(LOWERED[row['backend']])} are lowered)"
        elif row["backend"] in CHECKED and row["role"] not in _OPTIONS:
            verdicts[i] = "not checked (role: tools/offline_compile.py has no case that compiles it)"
        elif row["dtype"] != DTYPE:
            verdicts[i] = (f"not checked (dtype {row['dtype']}: "
                           f"{'lowered' if row['backend'] in LOWERED else 'tools/offline_compile.py compiles'} in "
                           f"{DTYPE} only)")
        else:
            try:
                groups.setdefault((row["arch"], _pair(row), _case_text(row)), []).append(i)
            except (TypeError, ValueError) as error:  # a hand-edited row: no JSON where its spec or config is
                verdicts[i] = f"error: the row's spec_json or config: {_one_line(error)}"
    carried = []
    if not groups:
        return verdicts, carried
    # OLD_REV compiles a case only where a row of it holds OLD_REV's hash (`_needed`); the current tree, all
    cases = []
    for (arch, pair, text), indices in groups.items():
        hashes = sorted({rows[i]["template_hash"] for i in indices}, key=str)
        cases.append(dict(case=json.loads(text), pair=pair, arch=arch, hashes=hashes))
    with _worktree(old_commit) as old_tree:
        results = _compile_both(old_tree, cases, jobs)
    for indices, (old_hashes, before, after) in zip(groups.values(), results):
        for i in indices:
            row = rows[i]
            if old_hashes is None:  # OLD_REV's process failed as a whole
                verdicts[i] = f"error: OLD_REV: {before['error']}"
            elif _pair(row) in old_hashes["hash_errors"]:
                verdicts[i] = f"not from OLD_REV (it has no such template: {old_hashes['hash_errors'][_pair(row)]})"
            elif row["template_hash"] != old_hashes["hashes"][_pair(row)]:
                verdicts[i] = f"not from OLD_REV (its template hash there is {old_hashes['hashes'][_pair(row)]})"
            else:
                verdicts[i] = _compare(row["role"], before, after, "cuda" if row["backend"] in LOWERED else "ptx")
                if verdicts[i] == "carried":
                    carried.append((row, current["hashes"][_pair(row)]))
    return verdicts, carried


def _pair(row: dict) -> str:
    """A row's "backend/role": the template it was tuned with (the backend that runs the role: `backends.runner`)."""
    return f"{row['backend']}/{row['role']}"


def _case_text(row: dict) -> str:
    """The case of a row, as JSON text (a dict key). Triton and Gluon: the tools/offline_compile.py case, its spec
    at its bucket's length, its config pinned for its role, the options that make the case compile the role, the
    PTX digests asked. TileLang (`_lower_cases`): the role lowered, its spec, config, bucket and dtype."""
    config = json.loads(row["config"]) if isinstance(row["config"], str) else row["config"]
    if row["backend"] in LOWERED:
        return json.dumps({"lower": row["role"], "spec": json.loads(row["spec_json"]), "n": int(row["bucket"]),
                           "config": config, "dtype": row["dtype"]}, sort_keys=True)
    case = {"spec": json.loads(row["spec_json"]), "n": int(row["bucket"]), **_OPTIONS[row["role"]], "ptx": True}
    if config is not None:
        case[row["role"]] = config
    return json.dumps(case, sort_keys=True)


def _needed(cases: list[dict], header: dict) -> list[int]:
    """Which of `cases` ({"case", "pair", "hashes"}) a tree's worker compiles, from its header: all, or with
    only_own_rows (OLD_REV's), those where a row of the case holds the tree's template hash."""
    if header.get("only_own_rows"):
        return [i for i, case in enumerate(cases) if header["hashes"].get(case["pair"]) in case["hashes"]]
    return list(range(len(cases)))


def _compile_both(old_tree: Path, cases: list[dict], jobs: int) -> list[tuple]:
    """Each case ({"case", "pair", "hashes", "arch"}) compiled (or lowered: a TileLang case) in OLD_REV's tree
    (where a row of it holds OLD_REV's hash) and the current one, side by side: [(OLD_REV's header or None,
    OLD_REV's result, the current one)] (a result: tools/offline_compile.py's or `_lower_cases`', {"error": ...},
    or {} where not compiled). A process compiles or lowers cases of one arch, `jobs` processes a tree at a time."""
    by_arch: dict[tuple[str, bool], list[int]] = {}  # (arch, lowered) -> cases
    for i, case in enumerate(cases):
        by_arch.setdefault((case["arch"], "lower" in case["case"]), []).append(i)
    results: dict[tuple[str, int], dict] = {}
    headers: dict[int, dict] = {}
    tasks = []
    with ThreadPoolExecutor(max_workers=2 * jobs) as pool:
        for side, tree in (("OLD_REV", old_tree), ("current tree", ROOT)):
            for (arch, lower), indices in by_arch.items():
                for chunk in (indices[k::jobs] for k in range(min(jobs, len(indices)))):
                    own = side == "OLD_REV"
                    pairs = sorted({cases[i]["pair"] for i in chunk}) if own else []
                    # OLD_REV's own script, unless it predates the "ptx" option: then this tree's
                    tasks.append((side, chunk, pool.submit(_tree_run, tree, pairs, [cases[i] for i in chunk], arch,
                                                           ROOT / SCRIPT if own else None, own, lower)))
        notes = set()
        for side, chunk, future in tasks:
            try:
                header, lines = future.result()
            except WorkerError as error:
                for i in chunk:
                    results[side, i] = {"error": f"compile process failed: {error}"}
                continue
            if header["script"] and header["script"] != str(Path(header["tree"]) / SCRIPT):
                notes.add(f"note: {side}'s {SCRIPT} has no \"ptx\" option: its kernels were compiled by "
                          f"{header['script']}, against its own kernelgen and templates")
            for i in chunk:
                results[side, i] = {}
                if side == "OLD_REV":
                    headers[i] = header
            for at, line in zip(_needed([cases[i] for i in chunk], header), lines):
                results[side, chunk[at]] = line
    for note in sorted(notes):
        print(note)
    return [(headers.get(i), results["OLD_REV", i], results["current tree", i]) for i in range(len(cases))]


def _compare(role: str, old: dict, new: dict, what: str = "ptx") -> str:
    """The verdict of a row from its case's results in OLD_REV's tree and the current one, by their digests of
    `what` ("ptx": tools/offline_compile.py's; "cuda": `_lower_cases`')."""
    for side, result in (("OLD_REV", old), ("current tree", new)):
        if "error" in result:
            return f"error: {side}: {_one_line(result['error'])}"
        if what not in result:
            return f"error: {side}: its result has no {what.upper()} digests"
    before, after = ([(k["name"], k["sha256"]) for k in result[what] if k["role"] == role] for result in (old, new))
    if not before or not after:
        side = "OLD_REV" if not before else "current tree"
        return f"error: {side}: the case compiled no kernel of role {role!r}"
    if before == after:
        return "carried"
    names = sorted({name for name, _ in set(before) ^ set(after)})
    return f"differs: {', '.join(names) or 'the order of its kernels'}"


def _one_line(text) -> str:
    """An error's text on one line: its first line, and its last where it has more (a Triton compile error names
    the source line first, the cause last)."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    line = " ... ".join(lines[:1] + lines[-1:] if len(lines) > 1 else lines)
    return line if len(line) <= 300 else line[:297] + "..."


def _tree_run(tree: Path, pairs: list, cases: list[dict] = (), arch: str | None = None, fallback: Path | None = None,
              only_own_rows: bool = False, lower: bool = False) -> tuple[dict, list]:
    """Run a worker (`_worker`) on `tree`'s kernelgen: (its header: where kernelgen and the templates were
    imported from, the template hashes of `pairs` ["backend/role"], the compile script run; the results of the
    cases it compiled, or with `lower` lowered (`_lower_cases`), `_needed`'s)."""
    request = {"tree": str(tree), "pairs": pairs, "cases": list(cases), "arch": arch, "script": str(tree / SCRIPT),
               "fallback": str(fallback) if fallback else None, "only_own_rows": only_own_rows, "lower": lower}
    # the tree's kernelgen first on the path; real compiles (a test process sets the interpreter), no line info;
    # empty Triton, kernelgen (rendered modules) and TileLang caches: no kernel or module made before stands in for
    # one (whatever a cache key misses), and no user's tuning files are read
    with tempfile.TemporaryDirectory(prefix="carry-winners-caches-") as caches:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")])),
               "TRITON_INTERPRET": "0", "TRITON_DISABLE_LINE_INFO": "1",
               **{name: str(Path(caches) / folder) for name, folder in (
                   ("TRITON_CACHE_DIR", "triton"), ("KERNELGEN_CACHE_DIR", "kernelgen"),
                   ("TILELANG_CACHE_DIR", "tilelang"))}}
        try:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker"],
                                  input=json.dumps(request), capture_output=True, text=True, env=env, cwd=tree,
                                  timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            raise WorkerError(f"no result after {TIMEOUT} s") from None
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    header = next((line for line in lines if "header" in line), None)
    if header is not None and "error" in header:
        raise WorkerError(header["error"])
    results = [line for line in lines if "case" in line]
    if (proc.returncode != 0 or header is None
            or [r["case"] for r in results] != list(range(len(_needed(request["cases"], header))))):
        raise WorkerError(_one_line(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else
                                    f"exit status {proc.returncode}, no results"))
    return header, results


def _worker() -> int:
    """In a process whose PYTHONPATH starts with a tree (`_tree_run`): check that kernelgen and its templates
    come from that tree, print a header (the template hashes asked), then the tree's offline compile of the cases
    it compiles (`_needed`; tools/offline_compile.py's JSON lines), or where the request says "lower", the CUDA
    source digests of its TileLang cases (`_lower_cases`)."""
    request = json.load(sys.stdin)
    tree = Path(request["tree"]).resolve()
    import kernelgen
    from kernelgen import backends
    from kernelgen.codegen import render

    where = {"kernelgen": str(Path(kernelgen.__file__).resolve()),
             "templates": str(Path(render.TEMPLATE_DIR).resolve())}
    for what, path in where.items():
        if not Path(path).is_relative_to(tree):
            print(json.dumps({"header": True, "error": f"{what} was imported from {path}, not from {tree}"}))
            return 1
    header = {"header": True, "tree": str(tree), **where, "hashes": {}, "hash_errors": {}, "script": None,
              "only_own_rows": request["only_own_rows"]}
    for pair in request["pairs"]:
        backend, role = pair.split("/")
        try:
            header["hashes"][pair] = backends.runner(backend, role).template_hash(role)
        except Exception as error:  # a role or backend this tree lacks
            header["hash_errors"][pair] = _one_line(error)
    cases = [request["cases"][i]["case"] for i in _needed(request["cases"], header)]
    module = None
    if cases and not request.get("lower"):
        for candidate in (request["script"], request["fallback"]):
            if candidate and Path(candidate).is_file():
                module, header["script"] = _load(Path(candidate)), candidate
                if hasattr(module, "ptx_digest"):
                    break
    print(json.dumps(header), flush=True)
    if request.get("lower"):
        _lower_cases(cases, request["arch"])
    elif module is not None:
        from kernelgen.archs import check_arch

        module.compile_cases(cases, check_arch(request["arch"]))
    return 0


def _lower_cases(cases: list[dict], arch: str) -> None:
    """In a worker (this tree's kernelgen imported: `_worker`), each TileLang case lowered to CUDA source for
    `arch`: a JSON line per case, {"case": i, "cuda": [{"role", "name", "sha256"}]} (name: its __global__ function,
    sha256: of the source as generated) or {"case": i, "error": "..."} (a kernelgen without the functions called
    included)."""
    for i, case in enumerate(cases):
        try:
            role, source = case["lower"], _lowered(case, arch)
            names = re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)\s*\(", source)
            result = {"case": i, "cuda": [{"role": role, "name": names[0] if names else role,
                                           "sha256": hashlib.sha256(source.encode()).hexdigest()}]}
        except Exception as error:  # the case's, not the process's: the next case is lowered still
            result = {"case": i, "error": f"{type(error).__name__}: {_one_line(error)}"}
        print(json.dumps(result), flush=True)


def _lowered(case: dict, arch: str) -> str:
    """A TileLang case's CUDA source, built as dispatch builds the role (`compiled_attn`, `compiled_bwd_dkdv`): its
    config checked on `arch`, the prim_func of its spec, config and shape (batch 1, HEADS_KV, seq_q = seq_k = its
    bucket), lowered with the build options dispatch gives the role on `arch`."""
    from kernelgen import Spec, backends
    from kernelgen.backends import tilelang

    role, backend = case["lower"], backends.get("tilelang")
    spec = Spec(**case["spec"])
    config = backend.config_from_dict(role, case["config"])
    backend.check_config(spec, role, config, arch)
    shape = dict(batch=1, heads_kv=HEADS_KV, seq_q=case["n"], seq_k=case["n"], config=config)
    if role == "attn":
        prim_func, options = tilelang.build_attn(spec, case["dtype"], **shape), tilelang.attn_pass_configs(config, arch)
    elif role == "bwd_dkdv":
        prim_func, options = tilelang.build_bwd_dkdv(spec, case["dtype"], **shape), tilelang.bwd_dkdv_pass_configs(arch)
    else:
        raise ValueError(f"role {role!r}: only {', '.join(LOWERED['tilelang'])} are lowered")
    return tilelang.lower(prim_func, arch, options)


def _load(path: Path):
    """A tools/*.py file as a module (tools/ is no package)."""
    spec = importlib.util.spec_from_file_location(f"_carry_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _worktree(commit: str):
    """OLD_REV's tree, checked out in a temporary directory beside the repository (the repository's index and
    branch untouched), removed afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="carry-winners-"))
    tree = tmp / "old"
    try:
        added = subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet", str(tree), commit],
                               capture_output=True, text=True)
        if added.returncode != 0:
            raise WorkerError(f"git worktree add of {commit[:12]} failed: {_one_line(added.stderr)}")
        yield tree.resolve()
    finally:
        removed = subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)],
                                 capture_output=True).returncode == 0
        shutil.rmtree(tmp, ignore_errors=True)
        if not removed:  # its directory is gone now: drop git's record of it
            subprocess.run(["git", "-C", str(ROOT), "worktree", "prune"], capture_output=True)


def _restamp(db: Path, key: tuple[str, ...], carried: list[tuple[dict, str]]) -> None:
    """Set the carried rows' template_hash to the current one, in one transaction; nothing else changes, the
    journal mode included (a row changed meanwhile: nothing is written)."""
    where = " AND ".join(f"{_quote(column)} = ?" for column in (*key, "template_hash"))
    with contextlib.closing(sqlite3.connect(db)) as conn:
        mode = conn.execute("PRAGMA journal_mode").fetchone()[0]
        with conn:
            for row, new_hash in carried:
                cursor = conn.execute(f"UPDATE {TABLE} SET template_hash = ? WHERE {where}",
                                      [new_hash, *(row[column] for column in key), row["template_hash"]])
                if cursor.rowcount != 1:
                    raise RuntimeError(f"{db}: row {row['spec_key']}/{row['role']} changed meanwhile; nothing written")
        after = conn.execute("PRAGMA journal_mode").fetchone()[0]
        if after != mode:
            raise RuntimeError(f"{db}: journal mode {mode!r} became {after!r}")


if __name__ == "__main__":
    sys.exit(main())
