"""`kernelgen tune --model config.json`: a Hugging Face config's distinct attention specs, each tuned."""
import json

import pytest
from typer.testing import CliRunner

from kernelgen import Spec
from kernelgen.cli import app
from kernelgen.errors import KernelgenValueError
from kernelgen.tuning.model import layer_type_specs, model_specs, model_studies

LLAMA = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 32, "num_key_value_heads": 8,
         "hidden_size": 4096, "num_hidden_layers": 32}
SPARSE = {"kv_block": 128, "q_tile": 128, "top_k": 16, "causal": True}


def test_heads_and_head_dim_come_from_the_config_and_sparse_options_from_kernelgen():
    assert model_specs({**LLAMA, "kernelgen": SPARSE}) == [
        ("full_attention", Spec(head_dim=128, gqa_group=4, local=1, **SPARSE))]
    # without a "kernelgen" object: the defaults the transformers integration serves, and kernelgen_<option> keys
    # (a loaded config's attributes) over them; an explicit head_dim wins over hidden / heads
    assert model_specs({**LLAMA, "head_dim": 64, "kernelgen_top_k": 8}) == [
        ("full_attention", Spec(head_dim=64, gqa_group=4, top_k=8, causal=True, local=1))]
    # multi-head attention (no num_key_value_heads), and a multimodal model's text_config
    assert model_specs({"text_config": {"num_attention_heads": 16, "hidden_size": 2048}}) == [
        ("full_attention", Spec(head_dim=128, gqa_group=1, causal=True, local=1))]
    # the schedule and backend are options too; a layer type with top_k 0 is not kernelgen's
    assert model_specs({**LLAMA, "kernelgen": {"schedule": "kv_centric", "backend": "auto"}})[0][1] == Spec(
        head_dim=128, gqa_group=4, causal=True, local=1, schedule="kv_centric", backend="auto")
    config = {**LLAMA, "layer_types": ["sliding_attention", "full_attention"],
              "kernelgen": {"layer_types": {"sliding_attention": {"top_k": 0}}}}
    assert layer_type_specs(config)["sliding_attention"] is None and len(model_specs(config)) == 1


def test_each_distinct_layer_type_is_one_spec():
    config = {**LLAMA, "head_dim": 128, "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
              "kernelgen": {**SPARSE, "layer_types": {"sliding_attention": {"top_k": 4, "local": 4}}}}
    assert model_specs(config) == [
        ("sliding_attention", Spec(head_dim=128, gqa_group=4, **{**SPARSE, "top_k": 4, "local": 4})),
        ("full_attention", Spec(head_dim=128, gqa_group=4, local=1, **SPARSE))]
    # a layer type without sparse options is not kernelgen's
    del config["kernelgen"]["layer_types"]
    assert [t for t, _ in model_specs(config)] == ["full_attention"]


@pytest.mark.parametrize("config, words", [
    ({"hidden_size": 4096}, "num_attention_heads must be a positive int"),
    ({**LLAMA, "num_key_value_heads": 5}, "not a multiple of num_key_value_heads=5"),
    ({**LLAMA, "kernelgen": {"top_k": 16, "heads": 3}}, "kernelgen has unknown options ['heads']"),
    ({**LLAMA, "kernelgen": {"causal": False}}, "a causal LM's attention is causal"),
    ({**LLAMA, "layer_types": ["sliding_attention"]}, "no layer type has sparse options"),
    ({**LLAMA, "hidden_size": 4000}, "head_dim"),
])
def test_bad_model_configs_are_named(config, words):
    with pytest.raises(KernelgenValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        model_specs(config)


def test_studies_cover_every_backend_the_arch_runs_and_the_selector():
    studies = list(model_studies({**LLAMA, "kernelgen": {**SPARSE, "selector": "mean"}}, 32768, 10, "sm_90"))
    roles = [(s.role, s.spec.backend) for s in studies]
    assert ("select", "triton") in roles and ("attn", "triton") in roles and ("attn", "tilelang") in roles
    assert ("decode", "triton") in roles  # generation, a token at a time
    assert all(s.shape == {"batch": 1, "heads_kv": 8, "n_q": 32768, "n_k": 32768} for s in studies)
    assert all(s.spec.selector == "given" for s in studies if s.role in ("attn", "decode"))


def test_cli_dry_run_plans_each_study(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELGEN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**LLAMA, "kernelgen": SPARSE}))
    result = CliRunner().invoke(app, ["tune", "--arch", "sm_90", "--seq", "32768", "--model", str(path), "--dry-run"])
    assert result.exit_code == 0, result.output
    assert "attn (triton)" in result.output and "attn (tilelang)" in result.output
    assert "'heads_q': 32, 'heads_kv': 8" in " ".join(result.output.split())
    for args, words in [(["--model", str(tmp_path / "missing.json")], "missing.json"),
                        (["--model", str(path), "--preset", "bench"], "give one"),
                        (["--model", str(tmp_path)], "Is a directory")]:
        bad = CliRunner().invoke(app, ["tune", "--arch", "sm_90", "--seq", "32768", "--dry-run", *args])
        lines = bad.stderr.strip().splitlines()
        assert bad.exit_code == 2 and len(lines) == 1 and words in lines[0], (bad.exit_code, bad.output)
    for args, words in [(["--top-k", "8"], "--model cannot be combined with --top-k"),
                        (["--spec", str(path)], "--model cannot be combined with --spec"),
                        (["--role", "bwd_dq"], "the model's studies tune attn, decode, select")]:
        bad = CliRunner().invoke(app, ["tune", "--arch", "sm_90", "--seq", "32768", "--dry-run", "--model", str(path),
                                       *args])
        assert bad.exit_code == 2 and words in bad.stderr, (args, bad.output)
    narrowed = CliRunner().invoke(app, ["tune", "--arch", "sm_90", "--seq", "32768", "--dry-run", "--model", str(path),
                                        "--role", "select"])
    assert narrowed.exit_code == 0 and "select (triton)" in narrowed.output and "attn (" not in narrowed.output
    path.write_text("{not json")
    bad = CliRunner().invoke(app, ["tune", "--arch", "sm_90", "--seq", "32768", "--dry-run", "--model", str(path)])
    assert bad.exit_code == 2 and "not JSON" in bad.stderr
