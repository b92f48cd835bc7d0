import json

import numpy as np
import pytest

import kernelgen
from kernelgen import Spec, backends
from kernelgen.roles import get_role


def test_defaults_and_derived():
    s = Spec(head_dim=128, kv_block=64, q_tile=64, top_k=16, causal=True, gqa_group=4, selector="multi:4", local=1, sink=1)
    assert s.groups == 4 and s.n_local == 1 and s.n_forced == 2
    assert s.n_q_tiles(130) == 3 and s.n_kv_blocks(64) == 1
    assert Spec(head_dim=64, causal=True).n_local == 1  # causal forces the diagonal block
    assert Spec(head_dim=64).n_local == 0


def test_frozen_hashable_json_round_trip():
    s = Spec(head_dim=64, top_k=8, selector="multi:2", local=2, sink=1)
    assert Spec.from_json(s.to_json()) == s
    assert hash(Spec.from_json(s.to_json())) == hash(s)
    assert json.loads(s.to_json())["selector"] == "multi:2"
    assert s.key() == Spec.from_dict(s.to_dict()).key() and s.key() != s.replace(top_k=9).key()
    with pytest.raises(Exception):
        s.top_k = 3


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(head_dim=72), "head_dim=72 is not supported; expected a multiple of 16 from 16 to 256"),
        (dict(head_dim=64, kv_block=48), "kv_block"),
        (dict(head_dim=64, q_tile=512), "q_tile"),
        (dict(head_dim=64, selector="max"), "selector"),
        (dict(head_dim=64, selector="multi:3"), "power of two"),
        (dict(head_dim=64, selector="multi:x"), "power of two"),
        (dict(head_dim=64, q_tile=16, selector="multi:32"), "divide"),
        (dict(head_dim=64, top_k=2, sink=2, local=1), "forced"),
        (dict(head_dim=64, top_k=1, sink=1, causal=True), "forced"),
        (dict(head_dim=64, schedule="kv_centric", q_tile=32), "no Q tile is used"),
        (dict(head_dim=64, schedule="kv_centric", kv_block=16, selector="multi:32"), "divide kv_block"),
        (dict(head_dim=64, schedule="foo"), "schedule"),
        (dict(head_dim=64, backend=""), "backend"),
        (dict(head_dim=64, gqa_group=0), "gqa_group"),
        (dict(head_dim=64, top_k=0), "top_k"),
        (dict(head_dim=64, local=-1), "local"),
        (dict(head_dim=64, top_k=10**20), "top_k=.*too large"),
        (dict(head_dim=64, gqa_group=2**31), "gqa_group=.*too large"),
    ],
)
def test_rejects_what_it_cannot_compute(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Spec(**kwargs)


def test_errors_are_kernelgen_errors():
    with pytest.raises(kernelgen.KernelgenValueError):
        Spec(head_dim=72)
    with pytest.raises(kernelgen.KernelgenTypeError):
        Spec(head_dim="64")


def test_unknown_backend_is_refused_where_it_is_served():
    spec = Spec(head_dim=64, backend="cuda")  # any name: plug-ins register theirs later
    with pytest.raises(ValueError, match=r"backend='cuda' is unknown; expected one of"):
        backends.check_spec(spec)
    with pytest.raises(ValueError, match="backend='cuda' is unknown"):
        kernelgen.get_kernel(spec)


def test_type_errors():
    with pytest.raises(TypeError, match="head_dim"):
        Spec(head_dim=64.0)
    with pytest.raises(TypeError, match="top_k"):
        Spec(head_dim=64, top_k=np.float64(4))
    # a NumPy integer is the int it is: the same spec, hash and JSON
    numpy_spec = Spec(head_dim=np.int64(64), top_k=np.int32(4))
    assert numpy_spec == Spec(head_dim=64, top_k=4) and type(numpy_spec.top_k) is int
    assert hash(numpy_spec) == hash(Spec(head_dim=64, top_k=4)) and Spec.from_json(numpy_spec.to_json()) == numpy_spec
    with pytest.raises(TypeError, match="causal"):
        Spec(head_dim=64, causal=1)
    with pytest.raises(ValueError, match="unknown fields"):
        Spec.from_dict({"head_dim": 64, "blocks": 3})
    with pytest.raises(ValueError, match="not a JSON object of Spec fields"):
        Spec.from_json("not json")
    with pytest.raises(ValueError, match="expected a JSON object of Spec fields, got list"):
        Spec.from_json("[1]")
    with pytest.raises(TypeError, match="takes a dict of Spec fields, got list"):
        Spec.from_dict([1])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(head_dim=256), r"head_dim=256 is not supported by backend='gluon'; expected one of \(64, 128\)"),
        (dict(head_dim=64, kv_block=32), r"kv_block=32 is not supported by backend='gluon'; expected one of "
                                         r"\(64, 128\)"),
        (dict(head_dim=64, q_tile=32), r"gqa_group \* Spec.q_tile = 1 \* 32 = 32 .* expected >= 64"),
        (dict(head_dim=128, q_tile=16, gqa_group=2), r"= 32 packed rows .* expected >= 64"),
        (dict(head_dim=64, q_tile=32, gqa_group=3), r"gqa_group=3 with q_tile=32 cannot be packed"),
        (dict(head_dim=64, schedule="kv_centric"), r"schedule='kv_centric' is not built for backend='gluon'"),
    ],
)
def test_gluon_rejects_what_its_kernel_cannot_compute(kwargs, match):
    """The Gluon forward is written for D and kv_block of 64 or 128 and 64 or 128 packed rows per
    program; any other spec is refused where it is served, naming the field, not when a kernel fails."""
    with pytest.raises(ValueError, match=match):
        kernelgen.get_kernel(Spec(backend="gluon", **kwargs))
    assert backends.get("gluon").spec_unsupported(Spec(**kwargs)) is not None
    backends.check_spec(Spec(**kwargs))  # the same spec is fine for Triton


@pytest.mark.parametrize("head_dim, kv_block, q_tile, gqa_group", [
    (64, 64, 64, 1), (128, 128, 128, 1), (128, 64, 16, 4), (64, 128, 32, 2), (128, 128, 64, 3), (64, 64, 16, 8)])
def test_gluon_accepts_what_its_kernel_computes(head_dim, kv_block, q_tile, gqa_group):
    spec = Spec(head_dim=head_dim, kv_block=kv_block, q_tile=q_tile, gqa_group=gqa_group, backend="gluon")
    assert backends.get("gluon").spec_unsupported(spec) is None
    backends.check_spec(spec)
    assert backends.runner("gluon", "select").name == "triton"  # selection runs the Triton selector
    assert get_role("select").kernel_spec(spec, "triton").backend == "triton"
    assert Spec.from_json(spec.to_json()) == spec
