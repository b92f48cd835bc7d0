"""tools/fuzz.py's randomized differential cases: a quick run of them here (on the GPU, every backend at up
to 4k tokens; context-parallel ones on simulated ranks), and the driver's bookkeeping."""
import json

import pytest
import torch

import checks
from checks import tool

fuzz = tool("fuzz")


@pytest.mark.parametrize("seed", range(12))
def test_random_cases_match_the_reference_or_are_refused(seed, device):
    case = fuzz.draw_case(seed, device, max_len=None if device == "cuda" else 40)
    result = fuzz.run_case(case)
    assert result["status"] in ("pass", "reject"), (json.dumps(case), result)


@pytest.mark.parametrize("seed", range(4))
def test_random_context_parallel_cases_match_the_whole_sequence(seed):
    case = fuzz.draw_distributed_case(seed)
    result = fuzz.run_case(case)
    assert result["status"] == "pass", (json.dumps(case), result)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(1000, 1064))
def test_gpu_random_cases_on_every_backend(seed):
    case = fuzz.draw_case(seed, "cuda")
    result = fuzz.run_case(case)
    assert result["status"] in ("pass", "reject"), (json.dumps(case), result)


def test_cases_replay_from_their_seed_and_cover_the_variety():
    assert fuzz.draw_case(7, "cuda") == fuzz.draw_case(7, "cuda")
    cases = [fuzz.draw_case(seed, "cuda") for seed in range(400)]
    assert {c["spec"]["backend"] for c in cases} == {"triton", "gluon", "tilelang", "auto"}
    assert {c["spec"]["schedule"] for c in cases} == {"q_centric", "kv_centric"}
    assert {c["lists"]["kind"] for c in cases if c["lists"]} == {"raw32", "raw64", "prepared"}
    assert any(c["index"] and c["index"]["dtype"] == "float8_e4m3fn" for c in cases)
    assert any(c["nq"] <= 16 for c in cases) and any(c["nq"] > 1024 for c in cases)
    assert any(c["ragged"] and c["lists"] for c in cases) and any(c["ragged"] and c["kept_reps"] for c in cases)
    assert any(c["paged"] and c["nq"] > 16 for c in cases)  # a prefill chunk over pages
    assert all(c["b"] * c["hkv"] * c["spec"]["gqa_group"] * c["nq"] * c["nk"] <= fuzz.MAX_SCORES["cuda"]
               for c in cases)
    assert all(c["spec"]["backend"] == "triton" and c["dtype"] in ("float32", "float16")
               for c in (fuzz.draw_case(seed, "cpu") for seed in range(100)))


def test_a_wrong_result_is_reported_not_passed(monkeypatch):
    case = fuzz.draw_case(0, "cpu", max_len=32)
    monkeypatch.setitem(checks.TOLERANCE, getattr(torch, case["dtype"]), (0.0, 0.0))
    assert fuzz.run_case(case)["status"] == "wrong"


def test_a_zero_reference_gradient_is_met_up_to_the_rounding_of_the_terms_it_cancels():
    # one key: p = 1, o = v, and dk = sum_i q_i * (do_i . v - do_i . o_i) is 0 exactly, as a sum of 34 terms of
    # size |q| |do| |v|; fp32 rounds each, so 1e-5 of error is rounding there, and a wrong value is not
    g = torch.Generator().manual_seed(0)
    q, do = (torch.randn(2, 2, 17, 64, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 1, 1, 64, generator=g) for _ in range(2))
    o = v.expand(2, 2, 17, 64)
    want = [torch.zeros(2, 2, 17, 64, dtype=torch.float64), torch.zeros(2, 1, 1, 64, dtype=torch.float64),
            (do.double().sum(dim=(1, 2), keepdim=True))]
    grads = [w.float() for w in want]
    inputs = (q, k, v, do, o, None)
    grads[1] = torch.full_like(grads[1], 1.01e-5)
    fuzz.compare_grads(grads, want, [True] * 3, torch.float32, torch, inputs)
    grads[1] = torch.full_like(grads[1], 0.5)
    with pytest.raises(fuzz.Failure, match="dk"):
        fuzz.compare_grads(grads, want, [True] * 3, torch.float32, torch, inputs)


def test_a_process_that_died_leaves_its_seed(tmp_path):
    rows = [dict(seed=3, status="start"), dict(seed=3, status="pass"), dict(seed=5, status="start")]
    (tmp_path / "worker-0.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"seed": 5, "sta')
    outcomes = fuzz.read_results(tmp_path)
    assert outcomes[3]["status"] == "pass" and outcomes[5]["status"] == "died"
