"""Shared test setup. Without CUDA, kernels run in the Triton interpreter (set before triton loads)."""
import atexit
import collections
import os
import shutil
import tempfile

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
os.environ["KERNELGEN_POISON"] = "1"  # outputs start as NaN: an unwritten element fails its check
if "KERNELGEN_CACHE_DIR" not in os.environ:  # one per run: xdist's workers and the tests' processes inherit it
    os.environ["KERNELGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="kernelgen-test-cache-")
    atexit.register(shutil.rmtree, os.environ["KERNELGEN_CACHE_DIR"], ignore_errors=True)

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    # The unmarked tests are the CPU suite: the kernels in Triton's interpreter, at small sizes in float32/float16
    # on CPU tensors. With CUDA visible the interpreter is off (it is process-wide), and they would fail, so a
    # CUDA machine runs them with CUDA hidden.
    skip = (pytest.mark.skip(reason="a CPU test (Triton's interpreter): on a CUDA machine run the CPU suite with CUDA "
                                    "hidden, CUDA_VISIBLE_DEVICES= python -m pytest -n auto")
            if HAS_CUDA else pytest.mark.skip(reason="needs a CUDA GPU"))
    for item in items:
        if ("gpu" in item.keywords) != HAS_CUDA:
            item.add_marker(skip)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most 4. Each worker holds torch, Triton and TileLang (about 1.5 GB),
    and the offline compile tests start processes of their own."""
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


@pytest.fixture
def device():
    return "cuda" if HAS_CUDA else "cpu"


@pytest.fixture
def nvcc_really_runs():
    """TileLang's on-disk cache would hand back an earlier build (without its cubin): switch it off."""
    import tilelang

    was_enabled = tilelang.is_cache_enabled()
    tilelang.disable_cache()
    yield
    if was_enabled:
        tilelang.enable_cache()


@pytest.fixture
def roles(monkeypatch):
    """The kernel roles kernelgen launches meanwhile, counted (a Counter by role name)."""
    import kernelgen

    seen = collections.Counter()
    launch = kernelgen.SparseAttention._launch

    def spy(self, served, *args, **options):
        seen[served.role] += 1
        return launch(self, served, *args, **options)

    monkeypatch.setattr(kernelgen.SparseAttention, "_launch", spy)
    return seen
