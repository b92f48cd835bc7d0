"""Length buckets: tunables are chosen per power-of-two bucket of the number of keys."""
from __future__ import annotations

from ..errors import KernelgenValueError

__all__ = ["seq_bucket", "MIN_BUCKET"]

MIN_BUCKET = 1024  # shorter sequences share the 1024 bucket


def seq_bucket(n: int) -> int:
    """The tuning bucket of sequence length `n`: the smallest power of two >= n, at least 1024.

    >>> seq_bucket(1), seq_bucket(1024), seq_bucket(1025), seq_bucket(5000)
    (1024, 1024, 2048, 8192)
    """
    n = int(n)
    if n < 0:
        raise KernelgenValueError(f"seq_bucket expects a sequence length >= 0, got {n}")
    return max(MIN_BUCKET, 1 << max(n - 1, 0).bit_length())
