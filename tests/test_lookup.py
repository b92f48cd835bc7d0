"""Dispatch's view of the tuning DB (`kernelgen.tuning.lookup`): which row a spec, role, device, dtype and
length are served, from which DB, and which backend `backend="auto"` serves. The GPU is faked (arch and
name); nothing launches."""
import dataclasses
import shutil

import pytest
import torch

import kernelgen.device
import kernelgen.dispatch
from kernelgen import (AttnConfig, BwdDkdvConfig, GluonAttnConfig, SelectConfig, Spec, TileLangAttnConfig,
                       TileLangBwdDkdvConfig, backends)
from kernelgen.codegen import render
from kernelgen.dispatch import SparseAttention
from kernelgen.errors import KernelgenValueError
from kernelgen.roles import get_role
from kernelgen.tuning import lookup
from kernelgen.tuning.buckets import seq_bucket
from kernelgen.tuning.db import Fingerprint, TuningDB, Winners, current_fingerprint, write_bundled_db
from kernelgen.tuning.rule import rule_backend

TRITON, TILELANG, GLUON = (backends.get(name) for name in ("triton", "tilelang", "gluon"))
GIVEN = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=16, selector="given")
CUDA = torch.device("cuda", 0)
WINNER = AttnConfig(block_m=64, num_warps=4, num_stages=2, use_tma=True)


def _fake_gpu(monkeypatch, arch="sm_90", name="NVIDIA H200"):
    """CUDA devices report `arch` and `name` (the CPU stays the CPU), as seen by the lookup and by the
    backends' device checks; Triton is not interpreting (as in a GPU process)."""
    def device_arch(device="cuda"):
        return arch if torch.device(device).type == "cuda" else "cpu"

    def gpu_name(device="cuda"):
        return name if torch.device(device).type == "cuda" else "cpu"

    for module in (lookup, kernelgen.device):
        monkeypatch.setattr(module, "device_arch", device_arch)
        monkeypatch.setattr(module, "gpu_name", gpu_name)
    monkeypatch.setattr(kernelgen.dispatch, "device_arch", device_arch)  # the configs it serves are the arch's
    monkeypatch.setattr(kernelgen.device, "interpreting", lambda: False)


@pytest.fixture
def user_db(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path))
    _fake_gpu(monkeypatch)
    db = TuningDB(tmp_path / "tuning.db")
    # the shipped winners would serve these specs too: each test says what its bundled DB holds
    empty_bundled = write_bundled_db(tmp_path / "empty-bundled.db")
    monkeypatch.setattr(lookup, "_winners", lambda: Winners(db, bundled_path=empty_bundled))
    lookup.recheck.cache_clear()
    yield db
    db.close()


def _key(spec, role):
    """(backend name, DB key) of `role`'s winners for `spec`: the backend that runs the role."""
    backend = backends.runner(spec.backend, role)
    return backend.name, get_role(role).key(spec, backend.name)


def _row(spec, role="attn", config=WINNER, bucket=32768, fingerprint=None, ms=0.2, arch="sm_90"):
    """One H200 row for spec (its backend's) and role, fingerprinted as this stack unless told."""
    backend, spec_key = _key(spec, role)
    return dict(spec_key=spec_key, role=role, backend=backend, arch=arch, gpu_name="NVIDIA H200", bucket=bucket,
                dtype="bfloat16", config=dataclasses.asdict(config), median_ms=ms, tflops=None, n_trials=1,
                fingerprint=fingerprint or current_fingerprint(backends.get(backend), role),
                spec_json=get_role(role).kernel_spec(spec, backend).to_json())


def _add(db, spec, **kwargs):
    db.upsert(**_row(spec, **kwargs))


def test_attention_winner_is_shared_by_every_selector(user_db):
    """The attention kernel only reads lists: a winner tuned with given lists serves `mean`,
    `multi:2` and forced-block specs of the same shape too; the selector's own role does not."""
    _add(user_db, GIVEN)
    for spec in (GIVEN, GIVEN.replace(selector="mean"), GIVEN.replace(selector="multi:2", local=1, sink=1)):
        assert lookup.tuned_config(TRITON, spec, "attn", seq_bucket(32768), torch.bfloat16, CUDA) == (WINNER, "user DB")
        assert lookup.tuned_config(TRITON, spec, "select", seq_bucket(32768), torch.bfloat16, CUDA) == (None, None)
        served = SparseAttention(spec).served("attn", 32768, device=CUDA)
        assert (served.backend, served.config, served.source) == (TRITON, WINNER, "user DB")
    # a different attention shape is another kernel
    assert lookup.tuned_config(TRITON, GIVEN.replace(top_k=8), "attn", 32768, torch.bfloat16, CUDA) == (None, None)


def test_misses(user_db):
    _add(user_db, GIVEN)
    assert lookup.tuned_config(TRITON, GIVEN, "attn", 32768, torch.float16, CUDA) == (None, None)  # dtype
    assert lookup.tuned_config(TRITON, GIVEN, "attn", 32768, torch.bfloat16, torch.device("cpu")) == (None, None)  # no GPU
    assert lookup.tuned_row(TRITON, GIVEN, "attn", 32768, torch.bfloat16, CUDA)["config"] == dataclasses.asdict(WINNER)
    # another backend's winners are not this one's
    assert lookup.tuned_config(TILELANG, GIVEN.replace(backend="tilelang"), "attn", 32768, torch.bfloat16,
                               CUDA) == (None, None)
    # a row from other templates is a miss (its bucket's neighbours included)
    stale = Fingerprint(**{**current_fingerprint(TRITON, "attn").as_columns(), "template_hash": "0" * 16})
    _add(user_db, GIVEN.replace(top_k=8), fingerprint=stale)
    assert lookup.tuned_config(TRITON, GIVEN.replace(top_k=8), "attn", 32768, torch.bfloat16, CUDA) == (None, None)
    served = SparseAttention(GIVEN.replace(top_k=8)).served("attn", 32768, device=CUDA)
    assert (served.config, served.source) == (WINNER, "user DB, nearest tuned spec")  # GIVEN's, not the stale one


def test_nearest_tuned_bucket(user_db):
    _add(user_db, GIVEN)
    assert lookup.tuned_config(TRITON, GIVEN, "attn", 131072, torch.bfloat16, CUDA) == (WINNER, "user DB")


def test_a_winner_s_source_names_its_db(user_db, tmp_path, monkeypatch):
    """A user row is served as "user DB" (and over a bundled row of the same key), a shipped one as
    "bundled DB"; with neither, dispatch says "default", and a caller's config "pinned"."""
    select_winner = SelectConfig(tiles=32, chunk=64)
    mean = GIVEN.replace(selector="mean")
    rows = [_row(GIVEN, config=AttnConfig(block_m=32)), _row(mean, role="select", config=select_winner)]
    bundled = write_bundled_db(tmp_path / "winners.db", [
        {**{k: v for k, v in r.items() if k != "fingerprint"}, **r["fingerprint"].as_columns(),
         "timestamp": "2026-01-01T00:00:00+00:00"} for r in rows])
    monkeypatch.setattr(lookup, "_winners", lambda: Winners(user_db, bundled_path=bundled))
    assert lookup.tuned_config(TRITON, mean, "select", 32768, torch.bfloat16, CUDA) == (select_winner, "bundled DB")
    assert lookup.tuned_row(TRITON, mean, "select", 32768, torch.bfloat16, CUDA)["source"] == "bundled"
    assert lookup.tuned_config(TRITON, GIVEN, "attn", 32768, torch.bfloat16, CUDA) == (AttnConfig(block_m=32),
                                                                                        "bundled DB")
    _add(user_db, GIVEN)  # measured here: it shadows the shipped row
    assert lookup.tuned_config(TRITON, GIVEN, "attn", 32768, torch.bfloat16, CUDA) == (WINNER, "user DB")
    attn = SparseAttention(mean)
    assert [(s.config, s.source) for s in (attn.served("select", 32768, device=CUDA),
                                           attn.served("attn", 32768, device=CUDA))] == [
        (select_winner, "bundled DB"), (WINNER, "user DB")]
    assert SparseAttention(mean).served("select", 32768, torch.float16, CUDA).source == "default"
    pinned = SparseAttention(mean, {"select": SelectConfig(tiles=16)}).served("select", 32768, device=CUDA)
    assert (pinned.config, pinned.source) == (SelectConfig(tiles=16), "pinned")


def test_a_broken_db_is_a_miss_never_a_crash(user_db, monkeypatch, caplog):
    _add(user_db, GIVEN)

    class Broken:
        def lookup(self, **key):
            raise RuntimeError("disk on fire")

    monkeypatch.setattr(lookup, "_winners", lambda: Broken())
    with caplog.at_level("WARNING", logger="kernelgen"):
        assert lookup.tuned_config(TRITON, GIVEN, "attn", 32768, torch.bfloat16, CUDA) == (None, None)
    assert "disk on fire" in caplog.text
    assert SparseAttention(GIVEN).served("attn", 32768, device=CUDA).source == "default"


def test_a_hand_edited_row_is_skipped_naming_its_key_and_hides_no_other_row(user_db, caplog):
    """Rows a hand edit left unusable (a bucket that is no length, a number that is text or negative, a config of
    wrong fields or types) are skipped, each with a warning naming its key: the key's good row is still served
    from the nearest bucket, and the nearest tuned spec's too (one bad row used to make the whole lookup fail)."""
    import contextlib
    import json
    import sqlite3

    _add(user_db, GIVEN)
    good = user_db.rows()[0]
    bad_rows = [{"bucket": 0}, {"bucket": "big"}, {"bucket": 65536, "median_ms": -1.0},
                {"bucket": 16384, "tflops": "fast"},
                {"bucket": 131072, "config": json.dumps({**dataclasses.asdict(WINNER), "block_m": "64"})},
                {"bucket": 262144, "config": json.dumps({"BLOCK_M": 64})}]
    with contextlib.closing(sqlite3.connect(user_db.path)) as conn, conn:
        for edit in bad_rows:
            row = {**good, "config": json.dumps(good["config"]), **edit}
            conn.execute(f"INSERT OR REPLACE INTO winners ({', '.join(row)}) VALUES ({', '.join('?' * len(row))})",
                         list(row.values()))
    with caplog.at_level("WARNING", logger="kernelgen"):
        assert len(user_db.rows()) == 3  # the good row and the two of bad configs, which only a backend can read
        for bucket in (1024, 16384, 32768, 65536, 131072, 262144):
            assert lookup.tuned_config(TRITON, GIVEN, "attn", bucket, torch.bfloat16, CUDA) == (WINNER, "user DB")
        served = SparseAttention(GIVEN.replace(top_k=8)).served("attn", 32768, device=CUDA)
        assert (served.config, served.source) == (WINNER, "user DB, nearest tuned spec")
    for said in ("'bucket': 0,", "'bucket': 'big'", "median_ms is -1.0", "tflops is 'fast'", "'bucket': 131072",
                 "'bucket': 262144"):
        assert said in caplog.text, said
    assert "lookup failed" not in caplog.text


# ---- backend="auto": the faster tuned backend per bucket ---------------------------------------------

AUTO = GIVEN.replace(backend="auto")
TL_WINNER = TileLangAttnConfig(block_m=64, num_stages=1, threads=128)


def _add_backend(db, backend, ms, config, bucket=32768, arch="sm_90"):
    _add(db, GIVEN.replace(backend=backend), config=config, bucket=bucket, ms=ms, arch=arch)


@pytest.fixture
def tilelang_installed(monkeypatch):
    monkeypatch.setattr(TILELANG, "not_installed", lambda: None)


@pytest.mark.parametrize("tl_ms, expect", [(0.15, "tilelang"), (0.25, "triton")])
def test_auto_serves_the_faster_backend(user_db, tilelang_installed, tl_ms, expect):
    _add_backend(user_db, "triton", 0.2, WINNER)
    _add_backend(user_db, "tilelang", tl_ms, TL_WINNER)
    attn = SparseAttention(AUTO)
    assert attn.backend(32768, device=CUDA) == expect
    assert lookup.fastest_backend(AUTO, 32768, torch.bfloat16, CUDA) == expect
    # past the per-shape limit (TileLang compiles per problem shape): the faster of those that compile once
    assert lookup.fastest_backend(AUTO, 32768, torch.bfloat16, CUDA, compiled_once=True) == "triton"
    assert attn.config("attn", 32768, 32768, device=CUDA) == (TL_WINNER if expect == "tilelang" else WINNER)
    assert attn.served("attn", 32768, device=CUDA).source == "user DB"
    assert attn.backend(32768, torch.float16, device=CUDA) == rule_backend(AUTO, "sm_90")  # nothing tuned for fp16: the rule
    assert isinstance(attn.config("select", 32768, 32768, device=CUDA), SelectConfig)  # selection stays in Triton
    assert attn.served("select", 32768, device=CUDA).backend is TRITON


def test_auto_compares_the_same_bucket_first(user_db, tilelang_installed):
    _add_backend(user_db, "triton", 0.2, WINNER, bucket=32768)
    _add_backend(user_db, "tilelang", 0.1, TL_WINNER, bucket=65536)  # faster, but measured on longer inputs
    assert SparseAttention(AUTO).backend(32768, device=CUDA) == "triton"
    assert SparseAttention(AUTO).backend(65536, device=CUDA) == "tilelang"


def test_a_row_outside_the_current_space_is_a_miss(user_db, tilelang_installed, caplog):
    """A row whose point is outside the current space (a point left out because its kernel hung, e.g.
    TileLang's three stages at D=64) is never served: dispatch warns and uses the defaults, and `auto`
    does not pick its backend."""
    left_out = TileLangAttnConfig(block_m=64, num_stages=3, threads=128, overlap=False)
    tilelang_spec = GIVEN.replace(backend="tilelang")
    _add_backend(user_db, "triton", 0.2, WINNER)
    _add_backend(user_db, "tilelang", 0.1, left_out)  # faster, so auto would pick it
    with caplog.at_level("WARNING", logger="kernelgen"):
        assert lookup.tuned_config(TILELANG, tilelang_spec, "attn", 32768, torch.bfloat16, CUDA) == (None, None)
    assert "does not run" in caplog.text
    served = SparseAttention(tilelang_spec).served("attn", 32768, device=CUDA)
    assert (served.config, served.source) == (TILELANG.default_config(tilelang_spec, "attn", "sm_90"), "default")
    assert SparseAttention(AUTO).backend(32768, device=CUDA) == "triton"
    assert SparseAttention(AUTO).config("attn", 32768, 32768, device=CUDA) == WINNER


def test_auto_without_rows_follows_the_measured_rule(user_db, tilelang_installed, monkeypatch):
    """No winner for the spec: the backend the rule measured fastest for its block size on this arch,
    among those that can serve it, with its default config; Triton where the rule knows nothing."""
    monkeypatch.setattr(GLUON, "not_installed", lambda: None)
    assert SparseAttention(AUTO).backend(32768, device=CUDA) == "gluon"  # 64-key blocks on sm_90
    assert SparseAttention(AUTO).config("attn", 32768, 32768, device=CUDA) == GLUON.default_config(GIVEN, "attn", "sm_90")
    blocks128 = AUTO.replace(kv_block=128, q_tile=128)
    assert SparseAttention(blocks128).backend(32768, device=CUDA) == "tilelang"
    monkeypatch.setattr(TILELANG, "not_installed", lambda: "no TileLang here")
    assert SparseAttention(blocks128).backend(32768, device=CUDA) == "gluon"  # the rule's next choice
    monkeypatch.setattr(GLUON, "not_installed", lambda: "no Gluon here")
    assert SparseAttention(blocks128).backend(32768, device=CUDA) == "triton"
    _fake_gpu(monkeypatch, "sm_89", "NVIDIA L40S")
    monkeypatch.setattr(TILELANG, "not_installed", lambda: None)
    assert SparseAttention(blocks128).backend(32768, device=CUDA) == "triton"  # not measured there: the fallback
    assert lookup.fastest_backend(blocks128, 32768, torch.bfloat16, torch.device("cpu")) == "triton"


def test_auto_without_rows_skips_a_backend_with_no_config_for_the_spec(user_db, tilelang_installed, monkeypatch):
    """A spec TileLang computes but cannot pack (16 rows a tile, where its programs hold 64 or 128) is served by
    the rule's next backend that has a config for it, not refused at every call."""
    monkeypatch.setattr(GLUON, "not_installed", lambda: None)
    few_rows = AUTO.replace(kv_block=128, q_tile=16)
    with pytest.raises(KernelgenValueError, match="no feasible TileLang attention config"):
        TILELANG.default_config(few_rows.replace(backend="tilelang"), "attn", "sm_90")
    attn = SparseAttention(few_rows)
    assert attn.backend(32768, device=CUDA) == "triton"  # Gluon holds at least 64 rows a program too
    assert attn.served("attn", 32768, device=CUDA).backend is TRITON
    assert SparseAttention(few_rows.replace(gqa_group=4)).backend(32768, device=CUDA) == "tilelang"  # 64 rows


def test_auto_with_rows_of_one_backend_serves_it(user_db, monkeypatch):
    _add_backend(user_db, "tilelang", 0.1, TL_WINNER)
    monkeypatch.setattr(TILELANG, "not_installed", lambda: "no TileLang here")
    assert SparseAttention(AUTO).backend(32768, device=CUDA) == rule_backend(AUTO, "sm_90", lambda b: b != "tilelang")
    monkeypatch.setattr(TILELANG, "not_installed", lambda: None)
    assert SparseAttention(AUTO).backend(32768, device=CUDA) == "tilelang"


def test_an_arch_is_served_the_configs_it_runs(user_db, monkeypatch, caplog):
    """On an L4 (sm_89: 99 KB of shared memory, no TMA): the defaults are sm_89's, a DB row holding a point
    sm_89 does not run (TMA) is a miss, and a pinned config that only other archs run is accepted when pinned
    (no device yet) and refused when served there."""
    _fake_gpu(monkeypatch, arch="sm_89", name="NVIDIA L4")
    big = Spec(head_dim=128, kv_block=128, q_tile=128, top_k=16, gqa_group=4, selector="given")
    served = SparseAttention(big).served("attn", 32768, device=CUDA)
    assert served.source == "default" and served.config == TRITON.default_config(big, "attn", "sm_89")
    assert served.config != TRITON.default_config(big, "attn", "sm_90")  # 128 rows of it need more than 99 KB
    user_db.upsert(**{**_row(GIVEN, arch="sm_89"), "gpu_name": "NVIDIA L4"})  # WINNER loads through TMA
    with caplog.at_level("WARNING", logger="kernelgen"):
        assert lookup.tuned_config(TRITON, GIVEN, "attn", 32768, torch.bfloat16, CUDA) == (None, None)
    assert "does not run" in caplog.text
    assert SparseAttention(GIVEN).served("attn", 32768, device=CUDA).source == "default"
    pinned = {GIVEN: (WINNER, "use_tma=True needs TMA"),
              big: (TRITON.default_config(big, "attn", "sm_90"), "at most 101376 on sm_89")}
    kernels = {spec: SparseAttention(spec, {"attn": cfg}) for spec, (cfg, _) in pinned.items()}  # no device yet
    for spec, (cfg, why) in pinned.items():
        with pytest.raises(KernelgenValueError, match=rf"configs\['attn'\] = .* not feasible for .* on sm_89: .*{why}"):
            kernels[spec].served("attn", 32768, device=CUDA)
    _fake_gpu(monkeypatch, arch="sm_90")
    for spec, (cfg, _) in pinned.items():
        assert kernels[spec].served("attn", 32768, device=CUDA).config == cfg


@pytest.mark.parametrize("reason", ["cannot serve this", RuntimeError("the device said something odd")])
def test_fastest_backend_skips_backends_that_cannot_serve(user_db, tilelang_installed, monkeypatch, reason):
    """`auto` asks each backend `unsupported(spec, device)`: one with a reason (or whose answer raises)
    is never chosen, however fast its row."""
    _add_backend(user_db, "triton", 0.2, WINNER)
    _add_backend(user_db, "tilelang", 0.1, TL_WINNER)
    assert lookup.fastest_backend(AUTO, 32768, torch.bfloat16, CUDA) == "tilelang"
    asked = []

    def unsupported(spec, device=None):
        asked.append((spec, device))
        if isinstance(reason, Exception):
            raise reason
        return reason

    monkeypatch.setattr(TILELANG, "unsupported", unsupported)
    assert lookup.fastest_backend(AUTO, 32768, torch.bfloat16, CUDA) == "triton"
    assert asked == [(AUTO, CUDA)]
    assert SparseAttention(AUTO).backend(32768, device=CUDA) == "triton"
    monkeypatch.setattr(TRITON, "unsupported", unsupported)  # then no backend has a row it may serve: the rule's
    assert lookup.fastest_backend(AUTO, 32768, torch.bfloat16, CUDA) == rule_backend(AUTO, "sm_90", {"gluon"}.__contains__)
    monkeypatch.setattr(GLUON, "unsupported", unsupported)
    assert lookup.fastest_backend(AUTO, 32768, torch.bfloat16, CUDA) == backends.FALLBACK


@pytest.mark.parametrize("tl_ms, expect", [(4.8, "tilelang"), (5.6, "triton")])
def test_auto_serves_each_backward_role_from_its_fastest_backend(user_db, tilelang_installed, tl_ms, expect):
    """Under auto, the backward's dK/dV (Triton's and TileLang's) goes to the backend whose own tuned row for
    that role is faster, whichever backend runs the attention; roles one backend has stay there; a pinned
    config names its backend; with no row the role runs where the attention runs."""
    _add_backend(user_db, "tilelang", 0.1, TL_WINNER)  # the attention: TileLang
    attn = SparseAttention(AUTO)
    assert attn.backend(32768, device=CUDA) == "tilelang"
    assert attn.served("bwd_dkdv", 32768, device=CUDA).backend is TILELANG  # no dK/dV row: the attention's backend
    assert lookup.fastest_backend(AUTO, 32768, torch.bfloat16, CUDA, "bwd_dkdv") is None
    triton_dkdv = BwdDkdvConfig(block_n=64, block_m=64, num_warps=4, num_stages=2)
    tilelang_dkdv = TileLangBwdDkdvConfig(block_n=64, block_m=64, num_stages=2, threads=128)
    _add(user_db, GIVEN, role="bwd_dkdv", config=triton_dkdv, ms=5.4)
    _add(user_db, GIVEN.replace(backend="tilelang"), role="bwd_dkdv", config=tilelang_dkdv, ms=tl_ms)
    attn = SparseAttention(AUTO)
    served = attn.served("bwd_dkdv", 32768, device=CUDA)
    assert (served.backend.name, served.source) == (expect, "user DB")
    assert served.config == (tilelang_dkdv if expect == "tilelang" else triton_dkdv)
    assert attn.served("bwd_dq", 32768, device=CUDA).backend is TRITON  # only Triton has it
    pinned = SparseAttention(AUTO, {"bwd_dkdv": triton_dkdv}).served("bwd_dkdv", 32768, device=CUDA)
    assert (pinned.backend, pinned.source) == (TRITON, "pinned")


def test_auto_with_a_pinned_config_follows_its_type():
    assert SparseAttention(AUTO, {"attn": TL_WINNER}).backend(32768, device="cpu") == "tilelang"
    assert SparseAttention(AUTO, {"attn": WINNER}).backend(32768, device="cpu") == "triton"
    assert SparseAttention(AUTO, {"attn": GL_WINNER}).backend(32768, device="cpu") == "gluon"


# ---- Gluon: served by "auto" on Hopper GPUs only -------------------------------------------------------

GL_WINNER = GluonAttnConfig(block_m=64, num_stages=3)


@pytest.fixture
def gluon_importable(monkeypatch):
    monkeypatch.setattr(GLUON, "not_installed", lambda: None)


@pytest.mark.parametrize("gl_ms, expect", [(0.1, "gluon"), (0.3, "tilelang")])
def test_auto_serves_gluon_when_its_row_is_fastest(user_db, tilelang_installed, gluon_importable, gl_ms, expect):
    _add_backend(user_db, "triton", 0.2, WINNER)
    _add_backend(user_db, "tilelang", 0.15, TL_WINNER)
    _add_backend(user_db, "gluon", gl_ms, GL_WINNER)
    attn = SparseAttention(AUTO)
    assert attn.backend(32768, device=CUDA) == expect
    assert attn.config("attn", 32768, 32768, device=CUDA) == (GL_WINNER if expect == "gluon" else TL_WINNER)
    assert isinstance(attn.config("select", 32768, 32768, device=CUDA), SelectConfig)  # selection stays in Triton


def test_auto_skips_gluon_off_hopper_or_without_gluon(user_db, gluon_importable, monkeypatch):
    """A Gluon row is never served where the kernel cannot run: another GPU generation (its rows say
    nothing there), no Gluon in this Triton, or a spec the Gluon forward does not compute."""
    for arch in ("sm_90", "sm_100"):
        _add_backend(user_db, "triton", 0.2, WINNER, arch=arch)
        _add_backend(user_db, "gluon", 0.1, GL_WINNER, arch=arch)
    assert SparseAttention(AUTO).backend(32768, device=CUDA) == "gluon"
    assert GLUON.unsupported(GIVEN, CUDA) is None
    _fake_gpu(monkeypatch, "sm_100", "NVIDIA B200")
    assert SparseAttention(AUTO).backend(32768, device=CUDA) == "triton"
    assert "runs on sm_90 only" in GLUON.unsupported(GIVEN, CUDA)
    _fake_gpu(monkeypatch, "sm_90", "NVIDIA H200")
    assert GLUON.unsupported(GIVEN, CUDA) is None
    assert GLUON.unsupported(GIVEN, torch.device("cpu"))
    assert GLUON.unsupported(GIVEN.replace(head_dim=256), CUDA)
    monkeypatch.setattr(GLUON, "not_installed", lambda: "no Gluon in this Triton")
    assert GLUON.unsupported(GIVEN, CUDA) == "no Gluon in this Triton"
    assert SparseAttention(AUTO).backend(32768, device=CUDA) == "triton"


def test_editing_one_template_keeps_the_other_roles_winners(user_db, tmp_path):
    """The fingerprint holds the hash of the role's own template: a new selector template makes the
    selector's winners misses, and leaves the attention's (never lose tuning data needlessly)."""
    mean = GIVEN.replace(selector="mean")
    select_winner = SelectConfig(tiles=32, chunk=64)
    _add(user_db, mean)
    _add(user_db, mean, role="select", config=select_winner)
    before = {(b.name, r): current_fingerprint(backends.runner(b.name, r), r).template_hash
              for b in backends.all_backends() for r in ("attn", "select")}
    assert len(set(before.values())) == 4  # Gluon and TileLang specs select with the Triton selector's template
    assert before["gluon", "select"] == before["tilelang", "select"] == before["triton", "select"]
    copy = tmp_path / "templates"
    shutil.copytree(render.TEMPLATE_DIR, copy)
    (copy / TRITON.role("select").template).write_text("# edited\n", encoding="utf-8")

    def clear():
        backends.Backend.template_hash.cache_clear()
        lookup._fingerprint.cache_clear()

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(render, "TEMPLATE_DIR", copy)
            clear()
            after = {(b.name, r): current_fingerprint(backends.runner(b.name, r), r).template_hash
                     for b in backends.all_backends() for r in ("attn", "select")}
            for backend in ("triton", "tilelang", "gluon"):
                assert after[backend, "select"] != before[backend, "select"]
                assert after[backend, "attn"] == before[backend, "attn"]
            assert lookup.tuned_config(TRITON, mean, "select", 32768, torch.bfloat16, CUDA) == (None, None)
            assert lookup.tuned_config(TRITON, mean, "attn", 32768, torch.bfloat16, CUDA) == (WINNER, "user DB")
    finally:
        clear()
    assert lookup.tuned_config(TRITON, mean, "select", 32768, torch.bfloat16, CUDA) == (select_winner, "user DB")
    with pytest.raises(KernelgenValueError, match="backend='cuda' is unknown"):
        backends.get("cuda").template_hash("attn")
    with pytest.raises(KernelgenValueError, match="does not run role 'select'"):
        TILELANG.template_hash("select")


def _bundled_rows():
    from kernelgen.tuning.db import BUNDLED_DB_PATH, _open_read_only, _select

    db = _open_read_only(BUNDLED_DB_PATH)
    assert db is not None
    return _select(db, {})


def test_bundled_winners_are_feasible_configs_of_their_specs():
    """Every shipped row parses, is keyed as dispatch looks it up, and names a point of its space."""
    rows = _bundled_rows()
    assert rows and all(r["arch"] == "sm_90" for r in rows)
    for row in rows:
        spec = Spec.from_json(row["spec_json"])
        backend = backends.get(row["backend"])
        assert backends.runner(spec.backend, row["role"]) is backend
        assert row["spec_key"] == get_role(row["role"]).key(spec, backend.name)
        assert backend.config_from_dict(row["role"], row["config"]) in backend.config_space(spec, row["role"],
                                                                                             row["arch"])


def test_bundled_winners_were_tuned_with_the_current_templates():
    """A shipped row whose template has changed since is only ever a miss: re-tune it or drop it."""
    from kernelgen.tuning.db import TABLE

    for row in _bundled_rows():
        backend = backends.get(row["backend"])
        assert row["template_hash"] == backend.template_hash(row["role"]), (
            f"{TABLE} row {row['spec_key']}/{row['role']}/{row['backend']} was tuned with another template: re-tune "
            "it on the GPU (kernelgen tune --preset bench) or drop it; stale rows are only ever misses")


# ---- another torch or CUDA runtime: served, re-checked first ------------------------------------------

def _other_runtime(fingerprint: Fingerprint, **columns) -> Fingerprint:
    return Fingerprint(**{**fingerprint.as_columns(), "torch_version": "2.11.0+cu130", "cuda_version": "13.0",
                          "kernelgen_version": "0.0.1", **columns})


def test_a_winner_of_another_runtime_is_served_after_its_recheck(user_db, monkeypatch, caplog):
    checked = []

    def check_config(backend, spec, role, config, seq, dtype, device):
        checked.append((backend.name, role, config, seq))
        return None

    monkeypatch.setattr("kernelgen.tuning.worker.check_config", check_config)
    _add(user_db, GIVEN, fingerprint=_other_runtime(current_fingerprint(TRITON, "attn")))
    row = lookup.tuned_row(TRITON, GIVEN, "attn", 32768, torch.bfloat16, CUDA)
    assert set(row["soft_mismatch"]) == {"torch_version", "cuda_version", "kernelgen_version"}
    with caplog.at_level("DEBUG", logger="kernelgen"):
        served = SparseAttention(GIVEN).served("attn", 32768, device=CUDA)
        assert (served.config, served.source) == (WINNER, "user DB")
        SparseAttention(GIVEN.replace(selector="mean")).served("attn", 32768, device=CUDA)
    assert checked == [("triton", "attn", WINNER, 32768)]  # once per process
    assert "measured under another kernelgen_version, torch_version, cuda_version; re-checked here" in caplog.text


def test_a_winner_of_another_runtime_that_fails_its_recheck_is_not_served(user_db, monkeypatch, caplog):
    monkeypatch.setattr("kernelgen.tuning.worker.check_config", lambda *args: "o differs from the reference")
    _add(user_db, GIVEN, fingerprint=_other_runtime(current_fingerprint(TRITON, "attn")))
    with caplog.at_level("WARNING", logger="kernelgen"):
        served = SparseAttention(GIVEN).served("attn", 32768, device=CUDA)
    assert (served.config, served.source) == (TRITON.default_config(GIVEN, "attn", "sm_90"), "default")
    assert "fails its check here (o differs from the reference)" in caplog.text


@pytest.mark.parametrize("column", ["template_hash", "triton_version"])
def test_a_winner_of_another_kernel_generator_is_a_miss(user_db, column):
    _add(user_db, GIVEN, fingerprint=_other_runtime(current_fingerprint(TRITON, "attn"), **{column: "other"}))
    assert lookup.tuned_row(TRITON, GIVEN, "attn", 32768, torch.bfloat16, CUDA) is None
    assert lookup.served_config(TRITON, GIVEN, "attn", 32768, torch.bfloat16, CUDA) is None


def test_recheck_runs_the_tuner_s_check_in_the_interpreter(tmp_path, monkeypatch, caplog):
    """No fake: a CPU winner recorded under another torch is checked against the reference in the
    interpreter before dispatch serves it, and the call's output is right."""
    from kernelgen import reference

    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path))
    spec = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=2, causal=True, selector="given")
    winner = AttnConfig(block_m=32, num_warps=4, num_stages=1)
    row = {**_row(spec, config=winner, bucket=1024, arch="cpu"), "gpu_name": "cpu", "dtype": "float32",
           "timestamp": "2026-01-01T00:00:00+00:00"}
    fingerprint = row.pop("fingerprint")
    bundled = write_bundled_db(tmp_path / "winners.db", [{**row, **_other_runtime(fingerprint).as_columns()}])
    db = TuningDB(tmp_path / "tuning.db")
    monkeypatch.setattr(lookup, "_winners", lambda: Winners(db, bundled_path=bundled))
    lookup.recheck.cache_clear()
    q, k, v = (torch.randn(1, 1, 200, 64) for _ in range(3))
    idx = torch.tensor([[[[0, 1], [1, 0], [2, 3], [3, -1]]]], dtype=torch.int32)
    attn = SparseAttention(spec)
    with caplog.at_level("DEBUG", logger="kernelgen"):
        o = attn(q, k, v, block_idx=idx)
    served = attn.served("attn", 200, torch.float32, "cpu")
    assert (served.config, served.source) == (winner, "bundled DB")
    assert "re-checked here: correct" in caplog.text
    ref = reference.sparse_attention(q.double(), k.double(), v.double(), spec, block_idx=idx)[0]
    assert ((o.double() - ref).norm() / ref.norm()).item() < 1e-4
    db.close()


# ---- a spec nobody tuned: the nearest tuned spec's winner ------------------------------------------------

def test_the_nearest_tuned_spec_s_winner_is_served(user_db):
    near, far = AttnConfig(block_m=64, num_warps=4, num_stages=3), AttnConfig(block_m=32, num_warps=4, num_stages=1)
    _add(user_db, GIVEN.replace(gqa_group=2), config=near)  # one doubling of the group away
    _add(user_db, GIVEN.replace(causal=True), config=far)  # causal differs: two
    _add(user_db, GIVEN.replace(head_dim=128), config=AttnConfig(block_m=16))  # another head_dim: never
    served = SparseAttention(GIVEN).served("attn", 32768, device=CUDA)
    assert (served.config, served.source) == (near, "user DB, nearest tuned spec")
    assert lookup.served_config(TRITON, GIVEN, "attn", 32768, torch.bfloat16, CUDA).transferred_from == \
        GIVEN.replace(gqa_group=2, backend="triton")
    other_dim = GIVEN.replace(head_dim=256)
    assert SparseAttention(other_dim).served("attn", 32768, device=CUDA).source == "default"
    other_blocks = GIVEN.replace(kv_block=128, q_tile=128)
    assert SparseAttention(other_blocks).served("attn", 32768, device=CUDA).source == "default"
    _add(user_db, GIVEN, config=WINNER)  # the spec's own winner beats any neighbour's
    lookup_again = SparseAttention(GIVEN.replace(local=1))  # (same attention kernel, a fresh cache)
    assert lookup_again.served("attn", 32768, device=CUDA).source == "user DB"


def test_a_padded_head_dim_is_served_the_winners_of_its_tile_width(user_db):
    """D=96 computes in 128-wide tiles: the nearest D=128 winner serves it, its own D=96 winner first; D=64's never."""
    wide, own = AttnConfig(block_m=64, num_warps=8, num_stages=2), AttnConfig(block_m=32, num_warps=4, num_stages=2)
    _add(user_db, GIVEN.replace(head_dim=64), config=AttnConfig(block_m=16))
    padded = GIVEN.replace(head_dim=96)
    assert SparseAttention(padded).served("attn", 32768, device=CUDA).source == "default"
    _add(user_db, GIVEN.replace(head_dim=128), config=wide)  # the same spec at D=128
    assert SparseAttention(padded).served("attn", 32768, device=CUDA).config == wide
    _add(user_db, padded.replace(gqa_group=4), config=own)  # farther in its group, but of its own D
    assert SparseAttention(padded.replace(sink=1)).served("attn", 32768, device=CUDA).config == own


def test_distance_weighs_group_length_density_and_causality():
    base = GIVEN
    assert lookup.spec_distance(base, 32768, base, 32768) == 0
    assert lookup.spec_distance(base, 32768, base.replace(gqa_group=4), 32768) == 2
    assert lookup.spec_distance(base, 32768, base.replace(causal=True), 32768) == 2
    # twice the length at the same top_k: one doubling of length, one of density
    assert lookup.spec_distance(base, 65536, base, 32768) == 2
    assert lookup.spec_distance(base.replace(top_k=32), 65536, base, 32768) == 1


def test_a_nearest_winner_infeasible_for_this_spec_is_skipped(user_db):
    """block_m=128 holds whole 64-query tiles of two heads at G=2; at G=1 it is no valid packing."""
    packed = AttnConfig(block_m=128, num_warps=8, num_stages=2)
    _add(user_db, GIVEN.replace(gqa_group=2), config=packed)
    assert TRITON.infeasible(GIVEN.replace(backend="triton"), "attn", packed, "sm_90")
    assert SparseAttention(GIVEN).served("attn", 32768, device=CUDA).source == "default"
    _add(user_db, GIVEN.replace(gqa_group=8), config=WINNER)  # farther, but feasible
    assert SparseAttention(GIVEN.replace(sink=1)).served("attn", 32768, device=CUDA).config == WINNER


def test_the_selector_s_winner_transfers_only_within_its_selector(user_db):
    mean = GIVEN.replace(selector="mean")
    winner = SelectConfig(tiles=32, chunk=64)
    _add(user_db, mean.replace(gqa_group=2), role="select", config=winner)
    assert SparseAttention(mean).served("select", 32768, device=CUDA).config == winner
    assert SparseAttention(GIVEN.replace(selector="multi:2")).served("select", 32768, device=CUDA).source == "default"


@pytest.mark.gpu
def test_bundled_winners_are_served_under_another_torch_on_the_gpu(monkeypatch, caplog):
    """The shipped DB, no fakes but the running torch's version: shape (c)'s bundled winners are served
    (after the re-check on this GPU, logged at debug) and compute the right result."""
    from kernelgen import reference
    from kernelgen.tuning import db as tuning_db
    from kernelgen.workloads import SHAPES

    monkeypatch.setattr(tuning_db, "_torch_versions", lambda: ("9.9.9+other", "99.9"))
    lookup._fingerprint.cache_clear()
    lookup._winners.cache_clear()
    lookup.recheck.cache_clear()
    try:
        shape = SHAPES["c"]
        spec = shape.spec("given").replace(backend="triton")
        rows = [r for r in _bundled_rows() if r["backend"] == "triton" and r["role"] == "attn"
                and r["spec_key"] == get_role("attn").key(spec, "triton")]
        assert rows and rows[0]["torch_version"] != "9.9.9+other"
        attn = SparseAttention(spec)
        with caplog.at_level("DEBUG", logger="kernelgen"):
            served = attn.served("attn", shape.n_k, torch.bfloat16, "cuda")
        assert served.source == "bundled DB"
        assert TRITON.config_to_dict(served.config) == rows[0]["config"]
        assert "measured under another torch_version, cuda_version; re-checked here: correct" in caplog.text
        q = torch.randn(1, 8, 4096, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(1, 8 // spec.gqa_group, 4096, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        idx = SparseAttention(spec.replace(selector="mean")).select(q, k)
        o = attn(q, k, v, block_idx=idx)
        ref = reference.sparse_attention(q.double(), k.double(), v.double(), spec, block_idx=idx)[0]
        assert ((o.double() - ref).norm() / ref.norm()).item() < 1e-2
    finally:
        lookup._fingerprint.cache_clear()
        lookup._winners.cache_clear()
        lookup.recheck.cache_clear()


# ---- the KV-centric schedule's two designs, chosen from their tuned rates ------------------------------

def test_the_union_designs_limit_comes_from_both_designs_tuned_rates(user_db):
    """With this spec's own winners of both designs on this GPU, the inflation up to which prepare serves the
    union design is where their rates meet (union rate x its workload's inflation / gathered rate), for the
    forward and the backward alike; with either missing, the H200 rule."""
    from kernelgen import KvAttnConfig, KvBwdConfig, KvUnionBwdConfig, KvUnionConfig
    from kernelgen.dispatch import SparseAttention
    from kernelgen.roles import union_workload_inflation
    from kernelgen.tile_union import union_max_inflation

    spec = Spec(head_dim=128, kv_block=64, top_k=16, gqa_group=16, causal=True, schedule="kv_centric",
                selector="given")
    bucket = 4096
    assert SparseAttention(spec)._union_limit(bucket, torch.bfloat16, CUDA) == union_max_inflation(64)
    for role, config, tflops in (("kv_attn", KvAttnConfig(), 100.0), ("kv_attn_union", KvUnionConfig(tile_q=4), 150.0),
                                 ("kv_bwd", KvBwdConfig(block_m=32), 120.0),
                                 ("kv_bwd_union", KvUnionBwdConfig(tile_q=8, block_m=32), 90.0)):
        user_db.upsert(**{**_row(spec, role, config=config, bucket=bucket), "tflops": tflops})
    attn = SparseAttention(spec)
    forward = 150.0 * union_workload_inflation(spec, bucket, 4) / 100.0
    backward = 90.0 * union_workload_inflation(spec, bucket, 8) / 120.0  # its rate per pair computed at its tile
    assert union_workload_inflation(spec, bucket, 4) > 1
    assert attn._union_limit(bucket, torch.bfloat16, CUDA) == pytest.approx(forward)
    assert attn._union_limit(bucket, torch.bfloat16, CUDA, backward=True) == pytest.approx(backward)
    pinned = SparseAttention(spec, {"kv_attn": KvAttnConfig()})  # a pinned design has no tuned rate
    assert pinned._union_limit(bucket, torch.bfloat16, CUDA) == union_max_inflation(64)
