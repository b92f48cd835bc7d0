"""Dispatch's view of the tuning DB (`kernelgen.tuned`): which row a spec, role, device, dtype and
length are served, and which backend `backend="auto"` serves. The GPU is faked (arch and name);
nothing launches."""
import pytest
import torch

from kernelgen import Spec, tuned
from kernelgen.config import AttnConfig, GluonAttnConfig, SelectConfig, TileLangAttnConfig, default_config, seq_bucket
from kernelgen.dispatch import SparseAttention
from kernelgen.db import TuningDB, current_fingerprint
from kernelgen.render import template_hash

GIVEN = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=16, selector="given")
CUDA = torch.device("cuda", 0)
WINNER = AttnConfig(block_m=64, num_warps=4, num_stages=2, use_tma=True)


@pytest.fixture
def user_db(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuned, "device_arch", lambda index: ("sm_90", "NVIDIA H200"))
    tuned._winners.cache_clear()
    db = TuningDB(tmp_path / "tuning.db")
    yield db
    db.close()
    tuned._winners.cache_clear()


def _add(db, spec, role="attn", config=WINNER, bucket=32768, fingerprint=None, ms=0.2, arch="sm_90"):
    """One H200 row for spec (its backend's) and role, fingerprinted as this stack unless told."""
    db.upsert(spec_key=spec.role_key(role), role=role, backend=spec.backend, arch=arch, gpu_name="NVIDIA H200",
              bucket=bucket, dtype="bfloat16", config=config.__dict__, median_ms=ms, tflops=None, n_trials=1,
              fingerprint=fingerprint or current_fingerprint(template_hash(spec.backend, role), spec.backend))


def test_attention_winner_is_shared_by_every_selector(user_db):
    """The attention kernel only reads lists: a winner tuned with given lists serves `mean`,
    `multi:2` and forced-block specs of the same shape too; the selector's own role does not."""
    _add(user_db, GIVEN)
    for spec in (GIVEN, GIVEN.replace(selector="mean"), GIVEN.replace(selector="multi:2", local=1, sink=1)):
        assert tuned.tuned_config(spec, "attn", seq_bucket(32768), torch.bfloat16, CUDA) == WINNER
        assert tuned.tuned_config(spec, "select", seq_bucket(32768), torch.bfloat16, CUDA) is None
    # a different attention shape is another kernel
    assert tuned.tuned_config(GIVEN.replace(top_k=8), "attn", 32768, torch.bfloat16, CUDA) is None


def test_misses(user_db):
    _add(user_db, GIVEN)
    assert tuned.tuned_config(GIVEN, "attn", 32768, torch.float16, CUDA) is None  # dtype
    assert tuned.tuned_config(GIVEN, "attn", 32768, torch.bfloat16, torch.device("cpu")) is None  # no GPU
    # a row from other templates is a miss (its bucket's neighbours included)
    _add(user_db, GIVEN.replace(top_k=8), fingerprint=current_fingerprint("0" * 16, "triton"))
    assert tuned.tuned_config(GIVEN.replace(top_k=8), "attn", 32768, torch.bfloat16, CUDA) is None


def test_nearest_tuned_bucket(user_db):
    _add(user_db, GIVEN)
    assert tuned.tuned_config(GIVEN, "attn", 131072, torch.bfloat16, CUDA) == WINNER


# ---- backend="auto": the faster tuned backend per bucket ---------------------------------------------

AUTO = GIVEN.replace(backend="auto")
TL_WINNER = TileLangAttnConfig(block_m=64, num_stages=1, threads=128)


def _add_backend(db, backend, ms, config, bucket=32768, arch="sm_90"):
    _add(db, GIVEN.replace(backend=backend), config=config, bucket=bucket, ms=ms, arch=arch)


@pytest.fixture
def tilelang_installed(monkeypatch):
    monkeypatch.setattr(tuned, "_tilelang_installed", lambda: True)


@pytest.mark.parametrize("tl_ms, expect", [(0.15, "tilelang"), (0.25, "triton")])
def test_auto_serves_the_faster_backend(user_db, tilelang_installed, tl_ms, expect):
    _add_backend(user_db, "triton", 0.2, WINNER)
    _add_backend(user_db, "tilelang", tl_ms, TL_WINNER)
    attn = SparseAttention(AUTO)
    assert attn.backend(32768) == expect
    assert attn.config("attn", 32768, 32768) == (TL_WINNER if expect == "tilelang" else WINNER)
    assert attn.backend(32768, torch.float16) == "triton"  # nothing tuned for fp16
    assert isinstance(attn.config("select", 32768, 32768), SelectConfig)  # selection stays in Triton


def test_auto_compares_the_same_bucket_first(user_db, tilelang_installed):
    _add_backend(user_db, "triton", 0.2, WINNER, bucket=32768)
    _add_backend(user_db, "tilelang", 0.1, TL_WINNER, bucket=65536)  # faster, but measured on longer inputs
    assert SparseAttention(AUTO).backend(32768) == "triton"
    assert SparseAttention(AUTO).backend(65536) == "tilelang"


def test_a_row_outside_the_current_space_is_a_miss(user_db, tilelang_installed, caplog):
    """A row whose point is outside the current space (a point left out because its kernel hung, e.g.
    TileLang's three stages at D=64) is never served: dispatch warns and uses the defaults, and `auto`
    does not pick its backend."""
    left_out = TileLangAttnConfig(block_m=64, num_stages=3, threads=128, overlap=False)
    _add_backend(user_db, "triton", 0.2, WINNER)
    _add_backend(user_db, "tilelang", 0.1, left_out)  # faster, so auto would pick it
    with caplog.at_level("WARNING", logger="kernelgen"):
        assert tuned.tuned_config(GIVEN.replace(backend="tilelang"), "attn", 32768, torch.bfloat16, CUDA) is None
    assert "no longer runs" in caplog.text
    assert SparseAttention(GIVEN.replace(backend="tilelang")).config("attn", 32768, 32768) == default_config(
        GIVEN.replace(backend="tilelang"), "attn")
    assert SparseAttention(AUTO).backend(32768) == "triton"
    assert SparseAttention(AUTO).config("attn", 32768, 32768) == WINNER


def test_auto_without_tilelang_or_rows(user_db, monkeypatch):
    assert SparseAttention(AUTO).backend(32768) == "triton"  # no rows: Triton and its defaults
    assert SparseAttention(AUTO).config("attn", 32768, 32768) == default_config(GIVEN, "attn")
    _add_backend(user_db, "tilelang", 0.1, TL_WINNER)
    monkeypatch.setattr(tuned, "_tilelang_installed", lambda: False)
    assert SparseAttention(AUTO).backend(32768) == "triton"


def test_auto_with_a_pinned_config_follows_its_type():
    assert SparseAttention(AUTO, {"attn": TL_WINNER}).backend(32768, device="cpu") == "tilelang"
    assert SparseAttention(AUTO, {"attn": WINNER}).backend(32768, device="cpu") == "triton"
    assert SparseAttention(AUTO, {"attn": GL_WINNER}).backend(32768, device="cpu") == "gluon"


# ---- Gluon: served by "auto" on Hopper GPUs only -------------------------------------------------------

GL_WINNER = GluonAttnConfig(block_m=64, num_stages=3)


@pytest.fixture
def gluon_importable(monkeypatch):
    monkeypatch.setattr(tuned, "_gluon_installed", lambda: True)


@pytest.mark.parametrize("gl_ms, expect", [(0.1, "gluon"), (0.3, "tilelang")])
def test_auto_serves_gluon_when_its_row_is_fastest(user_db, tilelang_installed, gluon_importable, gl_ms, expect):
    _add_backend(user_db, "triton", 0.2, WINNER)
    _add_backend(user_db, "tilelang", 0.15, TL_WINNER)
    _add_backend(user_db, "gluon", gl_ms, GL_WINNER)
    attn = SparseAttention(AUTO)
    assert attn.backend(32768) == expect
    assert attn.config("attn", 32768, 32768) == (GL_WINNER if expect == "gluon" else TL_WINNER)
    assert isinstance(attn.config("select", 32768, 32768), SelectConfig)  # selection stays in Triton


def test_auto_skips_gluon_off_hopper_or_without_gluon(user_db, gluon_importable, monkeypatch):
    """A Gluon row is never served where the kernel cannot run: another GPU generation (its rows say
    nothing there), no Gluon in this Triton, or a spec the Gluon forward does not compute."""
    for arch in ("sm_90", "sm_100"):
        _add_backend(user_db, "triton", 0.2, WINNER, arch=arch)
        _add_backend(user_db, "gluon", 0.1, GL_WINNER, arch=arch)
    assert SparseAttention(AUTO).backend(32768) == "gluon"
    monkeypatch.setattr(tuned, "device_arch", lambda index: ("sm_100", "NVIDIA B200"))
    assert SparseAttention(AUTO).backend(32768) == "triton"
    assert not tuned._gluon_runs(GIVEN, CUDA)
    monkeypatch.setattr(tuned, "device_arch", lambda index: ("sm_90", "NVIDIA H200"))
    assert tuned._gluon_runs(GIVEN, CUDA)
    assert not tuned._gluon_runs(GIVEN, torch.device("cpu"))
    assert not tuned._gluon_runs(GIVEN.replace(head_dim=256), CUDA)
    monkeypatch.setattr(tuned, "_gluon_installed", lambda: False)
    assert SparseAttention(AUTO).backend(32768) == "triton"


def test_editing_one_template_keeps_the_other_roles_winners(tmp_path, monkeypatch):
    """The fingerprint holds the hash of the role's own template: a new selector template makes the
    selector's winners misses, and leaves the attention's (never lose tuning data needlessly)."""
    import shutil

    from kernelgen import render

    before = {(b, r): template_hash(b, r) for b in ("triton", "tilelang", "gluon") for r in ("attn", "select")}
    assert len(set(before.values())) == 5  # Gluon specs select with the Triton selector's template
    assert before["gluon", "select"] == before["triton", "select"]
    copy = tmp_path / "templates"
    shutil.copytree(render.TEMPLATE_DIR, copy)
    (copy / render.TEMPLATES["triton"]["select"]).write_text("# edited\n", encoding="utf-8")
    monkeypatch.setattr(render, "TEMPLATE_DIR", copy)
    render.template_hash.cache_clear()
    try:
        assert template_hash("triton", "select") != before["triton", "select"]
        assert template_hash("triton", "attn") == before["triton", "attn"]
        assert template_hash("tilelang", "attn") == before["tilelang", "attn"]
        assert template_hash("gluon", "attn") == before["gluon", "attn"]
        assert template_hash("gluon", "select") != before["gluon", "select"]
    finally:
        render.template_hash.cache_clear()
    with pytest.raises(ValueError, match="no template"):
        template_hash("cuda", "attn")


def test_bundled_winners_are_feasible_configs_of_their_specs():
    """Every shipped row parses, is keyed as dispatch looks it up, and names a point of its space."""
    from kernelgen.config import config_from_dict, config_space
    from kernelgen.db import BUNDLED_DB_PATH, TABLE, _open_read_only, _select

    db = _open_read_only(BUNDLED_DB_PATH)
    assert db is not None
    rows = _select(db, {})
    assert rows and all(r["arch"] == "sm_90" for r in rows)
    for row in rows:
        spec = Spec.from_json(row["spec_json"])
        assert row["spec_key"] == spec.role_key(row["role"]) and row["backend"] == spec.backend
        assert config_from_dict(row["role"], row["config"], row["backend"]) in config_space(spec, row["role"])
        assert row["template_hash"] == template_hash(row["backend"], row["role"]), (
            f"{TABLE} row {row['spec_key']}/{row['role']} was tuned with another template: re-tune it on the GPU "
            "(tools/tune_benchmarks.py) or drop it; stale rows are only ever misses")
