"""Tune on first use (KERNELGEN_AUTOTUNE=1): the call is served at once, a background process tunes the
role into the user DB, and later calls serve its winner. Runs the interpreter end to end."""
import torch

from kernelgen import Spec, reference
from kernelgen.dispatch import SparseAttention
from kernelgen.tuning import autotune, lookup
from kernelgen.tuning.db import TuningDB, Winners, write_bundled_db

SPEC = Spec(head_dim=64, kv_block=64, q_tile=64, top_k=2, causal=True, selector="given")


def test_first_use_serves_at_once_and_tunes_in_the_background(tmp_path, monkeypatch):
    monkeypatch.setattr(autotune, "interpreting", lambda: False)  # as on a GPU: the interpreter starts no tune
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(autotune.ENV, "1")
    monkeypatch.setenv(autotune.TRIALS_ENV, "2")
    db = TuningDB(tmp_path / "tuning.db")
    monkeypatch.setattr(lookup, "_winners", lambda: Winners(db, bundled_path=write_bundled_db(tmp_path / "b.db")))
    q, k, v = (torch.randn(1, 1, 200, 64, dtype=torch.float16) for _ in range(3))
    idx = torch.tensor([[[[0, 1], [1, 0], [2, 3], [3, -1]]]], dtype=torch.int32)
    attn = SparseAttention(SPEC)
    o = attn(q, k, v, block_idx=idx)
    assert attn.served("attn", 200, torch.float16, "cpu").source == "default"
    assert autotune.running()
    attn(q, k, v, block_idx=idx)  # a second call while it tunes starts nothing new
    assert len(autotune._running) == 1
    generation = autotune.generation
    autotune.wait(timeout=600)
    assert autotune.generation == generation + 1 and not autotune.running()
    rows = db.rows(role="attn")
    assert len(rows) == 1 and rows[0]["arch"] == "cpu" and rows[0]["n_trials"] >= 1
    o2 = attn(q, k, v, block_idx=idx)  # reads the DB again
    served = attn.served("attn", 200, torch.float16, "cpu")
    assert served.source == "user DB" and served.backend.config_to_dict(served.config) == rows[0]["config"]
    ref = reference.sparse_attention(q.double(), k.double(), v.double(), SPEC, block_idx=idx)[0]
    for out in (o, o2):
        assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    db.close()


def test_the_interpreter_starts_no_tune(tmp_path, monkeypatch, caplog):
    """Its timings say nothing of a GPU's: switched on, a call in the interpreter starts no tune and says so."""
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(autotune.ENV, "1")
    monkeypatch.setattr(autotune, "_warned", set())
    q, k, v = (torch.randn(1, 1, 100, 64) for _ in range(3))
    SparseAttention(SPEC)(q, k, v, block_idx=torch.zeros(1, 1, 2, 2, dtype=torch.int32))
    assert not autotune.running() and "not tuned" in caplog.text


def test_off_by_default(tmp_path, monkeypatch):
    monkeypatch.delenv(autotune.ENV, raising=False)
    assert not autotune.enabled()
    monkeypatch.setenv(autotune.ENV, "1")
    monkeypatch.setenv(autotune.TRIALS_ENV, "lots")
    assert autotune.enabled() and autotune._trials() == autotune.DEFAULT_TRIALS


def test_the_switch_reads_the_usual_words_and_says_when_it_cannot(monkeypatch, caplog):
    for value in ("1", "true", "Yes", " on "):
        monkeypatch.setenv(autotune.ENV, value)
        assert autotune.enabled(), value
    for value in ("", "0", "false", "NO", "off"):
        monkeypatch.setenv(autotune.ENV, value)
        assert not autotune.enabled(), value
    assert not caplog.records
    monkeypatch.setenv(autotune.ENV, "sometimes")
    with caplog.at_level("WARNING", logger="kernelgen"):
        assert not autotune.enabled() and not autotune.enabled()
    assert len(caplog.records) == 1 and "'sometimes' is neither on" in caplog.records[0].getMessage()


def test_the_background_tune_runs_on_the_call_s_gpu(monkeypatch):
    """A call on cuda:1 tunes on cuda:1: the winner is stored for that GPU's kind (a host's GPUs may differ)."""
    import json

    jobs = []

    class Started:
        def __init__(self, argv, **kwargs):
            jobs.append(json.loads(argv[-1]))

    monkeypatch.setattr(autotune.subprocess, "Popen", Started)
    monkeypatch.setattr(autotune, "interpreting", lambda: False)
    monkeypatch.setattr(autotune, "_requested", set())
    monkeypatch.setattr(autotune, "_running", {})
    autotune.request(SPEC, "attn", 4096, torch.device("cuda", 1))
    autotune.request(SPEC, "attn", 4096, torch.device("cpu"))
    assert [job["device"] for job in jobs] == ["cuda:1", "cpu"]
