"""kernelgen.quality and `kernelgen quality`: recall and output error against brute force, full coverage,
monotonicity in top_k, capture of q/k/v at the attention call, and the command line."""
import csv
import importlib.util
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from test_cli import flat, invoke, one_line_error

from kernelgen import Spec, reference
from kernelgen.quality import ROOT, capture_qkv, full_coverage_note, selection_quality, summarize


def _layer(b=1, hq=4, hkv=2, n_q=96, n_k=96, seed=0, index=False):
    gen = torch.Generator().manual_seed(seed)
    layer = {"q": torch.randn(b, hq, n_q, 64, generator=gen) * 2, "k": torch.randn(b, hkv, n_k, 64, generator=gen),
             "v": torch.randn(b, hkv, n_k, 64, generator=gen)}
    if index:
        layer.update(q_idx=torch.randn(b, hkv * 2, n_q, 32, generator=gen),
                     k_idx=torch.randn(b, hkv, n_k, 32, generator=gen), w=torch.randn(b, hkv * 2, n_q, generator=gen))
    return layer


def _brute_force(layer, spec):
    """Recall and rel. error per query head in float64, the obvious way: dense softmax over every visible key,
    the mass of the listed keys, the sparse output of the reference."""
    q, k, v = layer["q"], layer["k"], layer["v"]
    n_q, n_k = q.shape[2], k.shape[2]
    lists = reference.select_blocks(q, k, spec)
    causal = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q) if spec.causal else torch.ones(n_q, n_k).bool()
    o_dense, lse = reference.attention(q, k, v, causal.expand(*k.shape[:2], -1, -1))
    g = q.shape[1] // k.shape[1]
    s = (q.double() @ k.double().repeat_interleave(g, 1).transpose(-1, -2)) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~causal, -torch.inf), -1).nan_to_num(0.0)
    listed = reference.token_mask(lists, spec, n_q, n_k).repeat_interleave(g, 1)
    seen = torch.isfinite(lse)
    recall = ((p * listed).sum(-1) * seen).sum((0, 2)) / seen.sum((0, 2))
    o_sparse = reference.sparse_attention(q, k, v, spec, block_idx=lists)[0]
    error = ((o_sparse - o_dense).square() * seen[..., None]).sum((0, 2, 3)).sqrt() / \
        (o_dense.square() * seen[..., None]).sum((0, 2, 3)).sqrt()
    return recall, error


def _by_head(rows, selector, top_k, field):
    return torch.tensor([r[field] for r in rows if r["selector"] == selector and r["top_k"] == top_k],
                        dtype=torch.float64)


@pytest.mark.parametrize("causal,n_q,n_k", [(True, 96, 96), (True, 72, 104), (False, 88, 56), (True, 88, 56)])
def test_recall_and_error_equal_brute_force(causal, n_q, n_k):
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, causal=causal, gqa_group=2, local=1 if causal else 0, sink=1)
    layer = _layer(n_q=n_q, n_k=n_k)
    rows = selection_quality({"l": layer}, spec, ["mean", "multi:4"], [2, 3], chunk_elements=4 * 32 * n_k)
    for selector in ("mean", "multi:4"):
        recall, error = _brute_force(layer, spec.replace(selector=selector, top_k=3))
        torch.testing.assert_close(_by_head(rows, selector, 3, "recall"), recall, rtol=0, atol=1e-12)
        torch.testing.assert_close(_by_head(rows, selector, 3, "rel_error"), error, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("causal", [True, False])
def test_full_coverage_keeps_everything_and_recall_grows_with_top_k(causal):
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, causal=causal, gqa_group=2)
    layers = {"a": _layer(n_q=80, n_k=100, index=True), "b": _layer(n_q=80, n_k=100, seed=1, index=True)}
    n_blocks = spec.n_kv_blocks(100)
    top_ks = [1, 2, 3, 5, n_blocks, n_blocks + 3]
    rows = selection_quality(layers, spec, ["mean", "multi:2", "index"], top_ks)
    assert len(rows) == 2 * 3 * len(top_ks) * 4 and {r["layer"] for r in rows} == {"a", "b"}
    for selector in ("mean", "multi:2", "index"):
        for layer in layers:
            mine = [r for r in rows if r["selector"] == selector and r["layer"] == layer]
            for top_k in top_ks[-2:]:  # every block listed: dense attention
                assert all(abs(r["recall"] - 1) < 1e-12 and r["rel_error"] < 1e-12 for r in mine
                           if r["top_k"] == top_k)
            for head in range(4):
                recalls = [r["recall"] for r in sorted(mine, key=lambda r: r["top_k"]) if r["head"] == head]
                assert all(a <= b + 1e-12 for a, b in zip(recalls, recalls[1:])), (selector, layer, head, recalls)
    summary = {(r["selector"], r["top_k"]): r for r in summarize(rows)}
    assert summary["mean", 1]["recall_min"] <= summary["mean", 1]["recall_mean"] < 1
    assert summary["index", n_blocks]["recall_mean"] == pytest.approx(1.0)


@pytest.mark.parametrize("causal", [True, False])
def test_per_query_lists_report_the_union_designs_inflation(causal):
    """Per-query lists: recall and error as brute force has them, and per KV head the union design's inflation
    over tiles of union_tile_q(G) queries, pooled over the batch; Q-centric lists report NaN."""
    from kernelgen.tile_union import build_tile_union, union_tile_q

    spec = Spec(head_dim=64, kv_block=16, causal=causal, gqa_group=2, schedule="kv_centric")
    layer = _layer(b=2, n_q=80, n_k=160)
    rows = selection_quality({"l": layer}, spec, ["mean"], [3])
    chosen = spec.replace(selector="mean", top_k=3)
    recall, error = _brute_force(layer, chosen)
    torch.testing.assert_close(_by_head(rows, "mean", 3, "recall"), recall, rtol=0, atol=1e-12)
    torch.testing.assert_close(_by_head(rows, "mean", 3, "rel_error"), error, rtol=1e-9, atol=1e-12)
    lists = reference.select_blocks(layer["q"], layer["k"], chosen)
    union = build_tile_union(lists, union_tile_q(2), spec.n_kv_blocks(160))
    for hkv in range(2):
        computed = sum(int((union.lists[b, hkv, t] >= 0).sum()) * min(32, 80 - 32 * t) for b in range(2)
                       for t in range(3))
        want = computed / int((lists[:, hkv] >= 0).sum())
        assert _by_head(rows, "mean", 3, "inflation")[2 * hkv:2 * hkv + 2].tolist() == pytest.approx([want] * 2)
    assert summarize(rows)[0]["inflation_mean"] >= 1
    q_centric = selection_quality({"l": layer}, Spec(head_dim=64, kv_block=16, q_tile=16, gqa_group=2), ["mean"], [3])
    assert all(math.isnan(r["inflation"]) for r in q_centric)


def test_the_selection_kernels_give_the_reference_lists():
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, causal=True, gqa_group=2)
    layer = _layer(n_q=64, n_k=64, seed=4)
    kernel_rows = selection_quality({"l": layer}, spec, ["mean"], [2], use_kernels=True)
    reference_rows = selection_quality({"l": layer}, spec, ["mean"], [2], use_kernels=False)
    for field in ("recall", "rel_error"):
        torch.testing.assert_close(_by_head(kernel_rows, "mean", 2, field), _by_head(reference_rows, "mean", 2, field))


def test_bad_inputs_name_what_is_wrong():
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, gqa_group=2)
    layers = {"l": _layer()}
    with pytest.raises(ValueError, match="'given' chooses no blocks"):
        selection_quality(layers, spec, ["given"], [2])
    with pytest.raises(ValueError, match="top_ks"):
        selection_quality(layers, spec, ["mean"], [])
    with pytest.raises(ValueError, match="spec.gqa_group = 1"):
        selection_quality(layers, spec.replace(gqa_group=1), ["mean"], [2])
    with pytest.raises(ValueError, match="spec.head_dim = 128"):
        selection_quality(layers, spec.replace(head_dim=128), ["mean"], [2])
    with pytest.raises(ValueError, match="index vectors"):
        selection_quality(layers, spec, ["index"], [2])
    with pytest.raises(ValueError, match="top_k"):  # fewer than its forced blocks
        selection_quality(layers, spec.replace(sink=2, local=1), ["mean"], [2])
    with pytest.raises(ValueError, match="no 'k'"):
        selection_quality({"l": {"q": layers["l"]["q"]}}, spec, ["mean"], [2])
    for bad in (-1.0, 0.0, math.nan):  # the kernels track each row's max on unscaled scores: scale > 0
        with pytest.raises((ValueError, TypeError), match="scale"):
            selection_quality(layers, spec, ["mean"], [2], scale=bad)
        with pytest.raises((ValueError, TypeError), match="layer 'l': recorded scale"):
            selection_quality({"l": {**layers["l"], "scale": bad}}, spec, ["mean"], [2])
    recorded = selection_quality({"l": {**layers["l"], "scale": torch.tensor(0.25)}}, spec, ["mean"], [2])
    given = selection_quality(layers, spec, ["mean"], [2], scale=0.25)
    assert [(r["recall"], r["rel_error"]) for r in recorded] == [(r["recall"], r["rel_error"]) for r in given]
    for selectors in (None, 5, [5]):  # not names: a TypeError naming selectors
        with pytest.raises(TypeError, match="selectors must be"):
            selection_quality(layers, spec, selectors, [2])
    for top_ks in (None, 2.0, "2", [2.0]):
        with pytest.raises(TypeError, match="top_ks must be"):
            selection_quality(layers, spec, ["mean"], top_ks)
    for device in ("banana", "meta"):  # neither a CPU nor a CUDA GPU
        with pytest.raises(ValueError, match=f"device must be cpu or cuda .*{device}"):
            selection_quality(layers, spec, ["mean"], [2], device=device)
    with pytest.raises(ValueError, match="layer 'l': q is a torch.strided tensor on meta"):
        selection_quality({"l": {k: t.to("meta") for k, t in layers["l"].items()}}, spec, ["mean"], [2])
    with pytest.raises(TypeError, match="use_kernels must be None, True or False"):  # "no" was taken as True
        selection_quality(layers, spec, ["mean"], [2], use_kernels="no")
    for chunk, error in ((1e6, TypeError), ("x", TypeError), (0, ValueError), (-5, ValueError)):
        with pytest.raises(error, match="chunk_elements must be"):
            selection_quality(layers, spec, ["mean"], [2], chunk_elements=chunk)
    with pytest.raises(ValueError, match="do not fit"):  # v of another head dim than k's
        selection_quality({"l": {**layers["l"], "v": layers["l"]["v"][..., :32]}}, spec, ["mean"], [2])
    for empty in ({"q": layers["l"]["q"][:, :, :0]}, {"k": layers["l"]["k"][:, :, :0]}, {"k": layers["l"]["k"][:, :0]},
                  {"q": layers["l"]["q"][:0], "k": layers["l"]["k"][:0]}):  # Nq, Nk, Hkv, B of 0: no NaN rows
        with pytest.raises(ValueError, match="must be at least 1"):
            selection_quality({"l": {"q": layers["l"]["q"], "k": layers["l"]["k"], **empty}}, spec, ["mean"], [2])


def test_inputs_that_are_not_finite_or_dense_are_refused_and_huge_budgets_list_every_block():
    """A NaN or inf in q, k or v (a head's recall NaN, which the summary then left out), scores that overflow,
    and a sparse tensor are refused naming the layer; a budget far past the blocks there are lists them all, with
    no list of that many slots (10**8 of them took gigabytes)."""
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, gqa_group=2)
    layer = _layer()
    for key, bad in (("q", math.nan), ("k", math.inf), ("v", -math.inf)):
        broken = layer[key].clone()
        broken[0, 0, 3, 5] = bad
        with pytest.raises(ValueError, match=f"layer 'l': {key} holds NaN or infinite values"):
            selection_quality({"l": {**layer, key: broken}}, spec, ["mean"], [2])
    with pytest.raises(ValueError, match="layer 'l': the scores q·k overflow"):
        selection_quality({"l": {**layer, "q": layer["q"].double() * 1e200, "k": layer["k"].double() * 1e200}}, spec,
                          ["mean"], [2])
    with pytest.raises(ValueError, match="layer 'l': q is a torch.sparse_coo tensor"):
        selection_quality({"l": {**layer, "q": layer["q"].to_sparse()}}, spec, ["mean"], [2])
    rows = selection_quality({"l": layer}, spec, ["mean"], [10 ** 8])
    assert all(abs(row["recall"] - 1) < 1e-12 and row["rel_error"] < 1e-12 for row in rows)


def test_rel_error_is_the_listed_keys_own_softmax_where_their_dense_weights_underflow():
    """The sparse output is the softmax over the listed keys, from the scores: listed keys 750 nats below the
    others have dense weights of 0 in float64, and renormalising those gave o_sparse = 0 (rel_error exactly 1)."""
    d, n = 64, 64
    q, k, v = torch.zeros(1, 1, n, d), torch.zeros(1, 1, n, d), torch.randn(1, 1, n, d, dtype=torch.float64)
    q[..., 0], k[:, :, 48:, 0] = 1.0, 6000.0  # block 3 scores 6000/8 = 750 above the others
    spec = Spec(head_dim=d, kv_block=16, q_tile=16, sink=1, top_k=1)  # every list: the sink block 0
    row = selection_quality({"l": {"q": q, "k": k, "v": v}}, spec, ["mean"], [1])[0]
    given = spec.replace(selector="given")
    o_sparse = reference.sparse_attention(q, k, v, given, block_idx=torch.zeros(1, 1, 4, 1, dtype=torch.int32))[0]
    every = torch.arange(4, dtype=torch.int32).view(1, 1, 1, 4).expand(1, 1, 4, 4)
    o_dense = reference.sparse_attention(q, k, v, given.replace(top_k=4), block_idx=every)[0]
    assert row["rel_error"] == pytest.approx(float((o_sparse - o_dense).norm() / o_dense.norm()), rel=1e-9)
    assert row["rel_error"] > 1.2


def test_index_vectors_are_checked_as_a_call_checks_them(tmp_path):
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, gqa_group=2)
    short_w = _layer(index=True)
    short_w["w"] = short_w["w"][..., :-1]
    with pytest.raises(ValueError, match="layer 'l': index: w.shape"):
        selection_quality({"l": short_w}, spec, ["index"], [2])
    odd_di = _layer(index=True)
    odd_di.update(q_idx=odd_di["q_idx"][..., :24], k_idx=odd_di["k_idx"][..., :24])
    with pytest.raises(ValueError, match="layer 'l': index: q_idx.shape.-1. = 24"):
        selection_quality({"l": odd_di}, spec, ["index"], [2])
    assert len(selection_quality({"l": short_w}, spec, ["mean"], [2])) == 4  # unused vectors are not read
    torch.save({"layers": {"l": short_w}}, tmp_path / "short_w.pt")
    one_line_error(invoke("quality", "--qkv", str(tmp_path / "short_w.pt"), "--kv-block", "16", "--q-tile", "16",
                          "--top-k", "2", "--out", str(tmp_path / "out")), "w.shape")


class _Attention(torch.nn.Module):
    """A Llama-shaped attention block: projections, then SDPA on k and v repeated per query head (repeat_kv)."""

    def __init__(self, causal_mask: bool):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = torch.nn.Linear(32, 4 * 64), torch.nn.Linear(32, 64), \
            torch.nn.Linear(32, 64)
        self.causal_mask = causal_mask

    def forward(self, x):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, 4, 64).transpose(1, 2)
        k, v = (p(x).view(b, n, 1, 64).transpose(1, 2).repeat_interleave(4, 1) for p in (self.k_proj, self.v_proj))
        if self.causal_mask:  # a float mask, as Hugging Face passes with padding
            mask = torch.zeros(n, n).masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), -torch.inf)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_capture_records_q_k_v_at_the_attention_call():
    model = torch.nn.Sequential(torch.nn.Identity(), _Attention(False), _Attention(True))  # 0 never calls SDPA
    x = torch.randn(2, 48, 32)
    original = F.scaled_dot_product_attention
    with capture_qkv(model, device=None) as layers:
        model[1](x)
        model[2](x)
        model[2](x[:1])  # a second forward pass of the same module: more batch
    assert F.scaled_dot_product_attention is original
    assert list(layers) == ["1", "2"]
    for name in layers:
        layer = layers[name]
        assert layer["k"].shape[1] == 1 and layer["q"].shape[1] == 4  # repeat_kv undone: one KV head
        assert layer["causal"] is True and layer["scale"] is None
    assert layers["2"]["q"].shape[0] == 3
    with torch.no_grad():
        want_k = model[1].k_proj(x).view(2, 48, 1, 64).transpose(1, 2)
    torch.testing.assert_close(layers["1"]["k"], want_k)
    with capture_qkv(model, layers=["2"]) as only:
        model[1](x)
        model[2](x)
    assert list(only) == ["2"] and only["2"]["q"].device.type == "cpu"
    with pytest.raises(ValueError, match="nope"):
        with capture_qkv(model, layers=["nope"]):
            pass
    with pytest.raises(TypeError, match="layers must be a module's name"):
        with capture_qkv(model, layers=5):
            pass
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        with capture_qkv("model"):
            pass
    spec = Spec(head_dim=64, kv_block=16, q_tile=16, causal=True, gqa_group=4)
    rows = selection_quality(layers, spec, ["mean"], [3])
    assert len(rows) == 2 * 4 and all(0 < r["recall"] <= 1 for r in rows)


def test_capture_warns_of_is_causal_with_fewer_queries_than_keys():
    """SDPA's is_causal is top-left aligned when Nq != Nk; kernelgen's causal mask is bottom-right."""
    class Call(torch.nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    model = Call()
    q, k, v = torch.randn(1, 1, 4, 64), torch.randn(1, 1, 8, 64), torch.randn(1, 1, 8, 64)
    with pytest.warns(UserWarning, match="top-left"), capture_qkv(model) as layers:
        model(q, k, v)
    assert layers[ROOT]["causal"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with capture_qkv(model):
            model(q, k[:, :, :4], v[:, :, :4])  # Nq == Nk: both alignments agree


def test_capture_warns_of_a_mask_it_does_not_keep():
    """A padding or window mask is not the causal one: recorded causal=False and no mask, so the capture says its
    quality is measured against another attention than the model's (it was silent)."""
    class Call(torch.nn.Module):
        def forward(self, q, k, v, mask):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = torch.randn(1, 1, 8, 64), torch.randn(1, 1, 8, 64), torch.randn(1, 1, 8, 64)
    model, padded = Call(), torch.ones(8, 8, dtype=torch.bool).tril()
    padded[:, :2] = False  # two left-padding positions
    with pytest.warns(UserWarning, match="attn_mask that is not the causal one"), capture_qkv(model) as layers:
        model(q, k, v, padded)
    assert not layers[ROOT]["causal"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with capture_qkv(model) as layers:
            model(q, k, v, torch.ones(8, 8, dtype=torch.bool).tril())  # the causal mask: recorded as causal
    assert layers[ROOT]["causal"]


def test_capture_names_the_model_s_own_attention_call_root():
    """SDPA called in the top-level forward: named_modules() names that module "", the capture "<root>"."""
    model = _Attention(False)
    x = torch.randn(1, 32, 32)
    with capture_qkv(model) as layers:
        model(x)
    assert list(layers) == [ROOT] == ["<root>"] and layers[ROOT]["q"].shape == (1, 4, 32, 64)
    for name in ("", ROOT):  # either name chooses it
        with capture_qkv(model, layers=[name]) as only:
            model(x)
        assert list(only) == [ROOT]


def test_full_coverage_note_names_the_budgets_that_list_every_block():
    assert full_coverage_note([2, 4, 8], 5) == ("top_k 8: at least the 5 KV blocks there are, so every block is "
                                                "listed (recall 1 says nothing of the selectors there)")
    assert full_coverage_note([4, 5, 6], 5).startswith("top_k 5, 6: at least the 5 KV blocks")
    assert full_coverage_note([2, 4], 5) is None


def _save(tmp_path, **layer_options):
    path = tmp_path / "qkv.pt"
    torch.save({"layers": {"layer0": {**_layer(n_q=64, n_k=64, **layer_options), "causal": True},
                           "layer1": {**_layer(n_q=64, n_k=64, seed=1, **layer_options), "causal": True}}}, path)
    return path


def test_cli_writes_the_table_csv_and_plot(tmp_path):
    path = _save(tmp_path, index=True)
    out = tmp_path / "out"
    result = invoke("quality", "--qkv", str(path), "--kv-block", "16", "--q-tile", "16", "--top-k", "1,2,4",
                    "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "causal" in result.output and "multi:4" in result.output and "index" in result.output
    with open(out / "quality.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 * 4 * 3 * 3 + 3 * 3  # layers x heads x selectors x top_ks, then the summary rows
    assert {r["selector"] for r in rows} == {"mean", "multi:4", "index"} and rows[-1]["layer"] == "all"
    full = [float(r["recall"]) for r in rows if r["top_k"] == "4"]
    assert all(abs(x - 1) < 1e-9 for x in full)  # 4 blocks of 16 keys: every block
    assert "top_k 4: at least the 4 KV blocks there are, so every block is listed" in " ".join(result.output.split())
    if importlib.util.find_spec("matplotlib"):
        assert (out / "quality.png").stat().st_size > 0
    else:
        assert "matplotlib is not installed" in result.output and not (out / "quality.png").exists()


def test_cli_reports_per_query_lists_union_inflation(tmp_path):
    path = _save(tmp_path)
    out = tmp_path / "out"
    result = invoke("quality", "--qkv", str(path), "--kv-block", "16", "--top-k", "1,2", "--schedule", "kv_centric",
                    "--out", str(out))
    assert result.exit_code == 0, result.output
    assert "inflation" in result.output and "per-query lists" in result.output
    assert "tuned winners" in flat(result.output)  # the limit of prepare() is the tuned crossover where one is
    with open(out / "quality.csv") as f:
        rows = list(csv.DictReader(f))
    assert all(float(r["inflation"]) >= 1 for r in rows)
    one_line_error(invoke("quality", "--qkv", str(path), "--schedule", "kv_centric", "--q-tile", "16"),
                   "--q-tile 16 with --schedule 'kv_centric'")
    one_line_error(invoke("quality", "--qkv", str(path), "--schedule", "bogus"), "--schedule 'bogus' is unknown")


class _NotATensor:
    """An object a file may hold that torch.load(weights_only=True) refuses."""


def test_cli_notes_a_capture_that_looks_like_b_n_h_d(tmp_path):
    """A [B, N, H, D] capture is read as [B, H, N, D] (N heads of H tokens): the command says so."""
    layer = {name: x.transpose(1, 2) for name, x in _layer(n_q=64, n_k=64).items() if name in ("q", "k", "v")}
    torch.save({"layers": {"l": layer}}, tmp_path / "bnhd.pt")
    result = invoke("quality", "--qkv", str(tmp_path / "bnhd.pt"), "--kv-block", "16", "--q-tile", "16",
                    "--top-k", "1", "--out", str(tmp_path / "out"))
    assert "are read as [B, H, N, D]: 64 heads of" in " ".join(result.output.split()), result.output
    result = invoke("quality", "--qkv", str(_save(tmp_path)), "--kv-block", "16", "--q-tile", "16", "--top-k", "1",
                    "--out", str(tmp_path / "out"))
    assert result.exit_code == 0 and "read as" not in result.output


def test_cli_bad_input_is_one_line(tmp_path):
    path = _save(tmp_path)
    one_line_error(invoke("quality", "--qkv", str(tmp_path / "missing.pt")), "--qkv", "no such file")
    (tmp_path / "text.pt").write_text("not a tensor file")
    one_line_error(invoke("quality", "--qkv", str(tmp_path / "text.pt")), "text.pt", "not a file of tensors that "
                   "torch.save wrote")
    torch.save({"layers": {"l": {"q": _NotATensor()}}}, tmp_path / "object.pt")  # weights_only refuses it
    result = invoke("quality", "--qkv", str(tmp_path / "object.pt"))
    one_line_error(result, "object.pt", "torch.save wrote", "_NotATensor")
    assert "weights_only" not in result.stderr and "\x1b" not in result.stderr  # no advice to unpickle it, no ANSI
    torch.save([torch.zeros(2)], tmp_path / "list.pt")
    one_line_error(invoke("quality", "--qkv", str(tmp_path / "list.pt")), "list.pt", "expected {'layers'")
    one_line_error(invoke("quality", "--qkv", str(path), "--top-k", "four"), "--top-k")
    one_line_error(invoke("quality", "--qkv", str(path), "--selectors", "index"), "index vectors")
    one_line_error(invoke("quality", "--qkv", str(path), "--selectors", "multi:3"), "--selectors 'multi:3'")
    one_line_error(invoke("quality", "--qkv", str(path), "--selectors", "given"), "--selectors 'given'")
    one_line_error(invoke("quality", "--qkv", str(path), "--kv-block", "16", "--sink", "3", "--top-k", "2"),
                   "--top-k 2 cannot hold", "--sink 3")
    for budgets in ("0", "4,0", "-4"):  # each budget, not only the largest
        one_line_error(invoke("quality", "--qkv", str(path), "--top-k", budgets), f"--top-k '{budgets}'", ">= 1")
    one_line_error(invoke("quality", "--qkv", str(path), "--kv-block", "48"), "--kv-block 48 is not supported")
    torch.save({"layers": {"l": {"q": torch.randn(1, 2, 8, 40), "k": torch.randn(1, 2, 8, 40)}}}, tmp_path / "d40.pt")
    one_line_error(invoke("quality", "--qkv", str(tmp_path / "d40.pt")), "--qkv", "d40.pt", "head dim 40")
    torch.save({"layers": {"l": {"q": torch.randn(1, 2, 8, 64).int(), "k": torch.randn(1, 2, 8, 64)}}},
               tmp_path / "int.pt")
    one_line_error(invoke("quality", "--qkv", str(tmp_path / "int.pt")), "--qkv", "int.pt", "4-D float tensor")
    torch.save({"something": 1}, tmp_path / "other.pt")
    one_line_error(invoke("quality", "--qkv", str(tmp_path / "other.pt")), "layers")
    files = {"no_kv_heads": {"l": {"q": torch.randn(1, 2, 8, 64), "k": torch.randn(1, 0, 8, 64)}},
             "causal_text": {"l": {**_layer(n_q=64, n_k=64), "causal": "False"}},
             "causal_pair": {"l": {**_layer(n_q=64, n_k=64), "causal": torch.tensor([True, False])}},
             "sparse_q": {"l": {**_layer(n_q=64, n_k=64), "q": _layer(n_q=64, n_k=64)["q"].to_sparse()}},
             "meta": {"l": {key: t.to("meta") for key, t in _layer(n_q=64, n_k=64).items()}},
             "one_name_twice": {1: _layer(n_q=64, n_k=64), "1": _layer(n_q=64, n_k=64)}}
    said = {"no_kv_heads": "must be at least 1", "causal_text": "recorded causal must be a bool",
            "causal_pair": "recorded causal must be a bool", "sparse_q": "sparse_coo", "meta": "on meta",
            "one_name_twice": "two layers are named '1'"}
    for name, layers in files.items():  # tracebacks (or a string 'False' read as causal, two layers as one) before
        torch.save({"layers": layers}, tmp_path / f"{name}.pt")
        one_line_error(invoke("quality", "--qkv", str(tmp_path / f"{name}.pt"), "--kv-block", "16", "--q-tile", "16"),
                       f"{name}.pt", said[name])

    class Payload:
        def __reduce__(self):
            return (print, ("ran",))

    torch.save({"x": Payload()}, tmp_path / "payload.pt")  # refused by the weights-only unpickler, saying why
    one_line_error(invoke("quality", "--qkv", str(tmp_path / "payload.pt")), "payload.pt",
                   "Unsupported global: GLOBAL print")


def test_cli_header_spans_layers_of_different_lengths(tmp_path):
    """Each layer is measured at its own length; the header gives the span, and the full-coverage note names only
    budgets that list every block of every layer (it was the first layer's)."""
    path = tmp_path / "lengths.pt"
    torch.save({"layers": {"short": _layer(n_q=64, n_k=64), "long": _layer(n_q=128, n_k=128, seed=1)}}, path)
    result = invoke("quality", "--qkv", str(path), "--kv-block", "16", "--q-tile", "16", "--top-k", "4,8",
                    "--selectors", "mean", "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "Nq=64–128, Nk=64–128" in text and "(4–8 KV blocks)" in text
    assert "top_k 8: at least the 8 KV blocks" in text and "top_k 4" not in text


def test_cli_refuses_layers_that_record_causal_differently(tmp_path):
    """One spec measures every layer: a file whose layers record causal differently is refused without --causal /
    --no-causal, and measured with either."""
    path = tmp_path / "mixed.pt"
    torch.save({"layers": {"self": {**_layer(n_q=64, n_k=64), "causal": True},
                           "cross": {**_layer(n_q=64, n_k=64, seed=1), "causal": False}}}, path)
    one_line_error(invoke("quality", "--qkv", str(path), "--kv-block", "16", "--top-k", "2"), "1 of 2 layers",
                   "--no-causal")
    result = invoke("quality", "--qkv", str(path), "--kv-block", "16", "--q-tile", "16", "--top-k", "2", "--causal",
                    "--out", str(tmp_path / "out"))
    assert result.exit_code == 0, result.output

