"""Random numbers addressed by position: element ``i`` of a stream, without elements ``0..i-1``.

A stream is identified by a 64-bit ``key``. Its element ``i`` (any non-negative integer below
2^63) is the ``i``-th output of SplitMix64 started at ``key``: the 64-bit mix of
``key + (i + 1) * 0x9E3779B97F4A7C15`` (mod 2^64). Any set of positions — a block of rows, a
column block, a strided or transposed block of a matrix — is computed directly from the
positions, so a tensor-parallel rank draws its shard of a weight without drawing the rest.

From the 64 bits of an element, in float32:

* :func:`standard_normal` — one N(0, 1) value by the Box-Muller transform: the high 24 bits
  give ``u1`` in (0, 1], bit 23 a sign and the low 23 bits ``v`` in [0, 1); the value is
  ``±sqrt(-2 ln u1) * cos(pi v / 2)``, which is distributed as ``sqrt(-2 ln u1) * cos(2 pi u)``
  for a uniform ``u`` (so |value| <= 5.77);
* :func:`uniform` — one value in [0, 1) from the high 24 bits.

Reproducibility: the logarithm and the cosine are polynomials built only of IEEE-754
operations that are correctly rounded (``+ - * /``, ``sqrt``, exponent and mantissa read off
the float bits), each a separate numpy call, so every platform and numpy version computes the same bits (no libm, no SIMD
approximations of transcendental functions). Their error is a few float32 ulps. Integer
arithmetic is on numpy ``uint64`` arrays, which wrap modulo 2^64.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

__all__ = ["Workspace", "bits", "standard_normal", "stream_key", "uniform"]

_F = np.float32
_GAMMA = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_LN2 = _F(math.log(2.0))
_SQRT2_BITS = np.uint32(np.array(math.sqrt(2.0), dtype=_F).view(np.uint32))
# ln m = 2 s (1 + s^2/3 + ... + s^8/9), s = (m - 1) / (m + 1), m in [sqrt(1/2), sqrt(2)),
# |s| <= 0.172: coefficients in s^2, highest first
_LOG_SERIES = tuple(_F(2.0 / k) for k in range(9, 0, -2))
# cos t = 1 - t^2/2! + ... + t^12/12! on [0, pi/2]: coefficients in t^2, highest first
_COS_SERIES = tuple(_F((-1) ** k / math.factorial(2 * k)) for k in range(6, -1, -1))
_QUARTER_TURN = _F(math.pi / 2 * 2.0**-23)


def stream_key(seed: int, name: str) -> int:
    """The key of the stream named ``name`` under ``seed``: 64 bits of SHA-256 of ``"seed:name"``."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


class Workspace:
    """Scratch arrays for drawing up to ``size`` elements per call, reused from call to call.

    Drawing is a few dozen elementwise passes; with fresh temporaries, each large one is new
    memory the kernel must fault in and zero, which costs more than the arithmetic. Give
    :func:`standard_normal` / :func:`uniform` one workspace and an ``out`` array when drawing
    piece after piece. Not thread-safe: one workspace per thread.
    """

    def __init__(self, size: int):
        self.size = size
        self.hash = np.empty(size, np.uint64)
        self.shifted = np.empty(size, np.uint64)
        self.low = np.empty(size, np.uint32)
        self.word = np.empty(size, np.uint32)
        self.float_bits = np.empty(size, np.uint32)
        self.scratch = np.empty(size, _F)
        self.term = np.empty(size, _F)
        self.high = np.empty(size, np.bool_)

    def views(self, n: int):
        """The first ``n`` elements of every array, in the order of the attributes."""
        if n > self.size:
            raise ValueError(f"{n} elements do not fit a workspace of {self.size}")
        return (
            self.hash[:n], self.shifted[:n], self.low[:n], self.word[:n], self.float_bits[:n],
            self.scratch[:n], self.term[:n], self.high[:n],
        )  # fmt: skip


def _bits_into(key: int, positions: np.ndarray, z: np.ndarray, shifted: np.ndarray) -> np.ndarray:
    """:func:`bits` written into ``z`` (``uint64``, ``positions``' size), ``shifted`` scratch."""
    np.copyto(z, positions.reshape(-1), casting="unsafe")
    z += np.uint64(1)
    z *= _GAMMA
    z += np.uint64(key)
    for shift, multiplier in ((30, _MIX1), (27, _MIX2), (31, None)):
        np.right_shift(z, np.uint64(shift), out=shifted)
        z ^= shifted
        if multiplier is not None:
            z *= multiplier
    return z


def bits(key: int, positions: np.ndarray) -> np.ndarray:
    """The stream's 64-bit elements at ``positions`` (a non-negative integer array), flat."""
    z = np.empty(positions.size, np.uint64)
    return _bits_into(key, positions, z, np.empty_like(z))


def _polynomial_into(x: np.ndarray, coefficients, out: np.ndarray) -> np.ndarray:
    """Horner into ``out``: ``coefficients`` (highest power first) evaluated at ``x``."""
    np.multiply(x, coefficients[0], out=out)
    out += coefficients[1]
    for c in coefficients[2:]:
        out *= x
        out += c
    return out


def _log_of_counts_into(counts, out, float_bits, scratch, term, high) -> np.ndarray:
    """``ln(counts / 2^24)`` (float32) into ``out`` for ``uint32`` integers ``counts`` in
    [1, 2^24]; ``counts`` is overwritten, the other arguments are scratch of its size."""
    # counts = m 2^e exactly: e and m read off the float32 bits, m in [1, 2), then moved to
    # [sqrt(1/2), sqrt(2)) (halved, e one more)
    np.copyto(float_bits.view(_F), counts, casting="unsafe")
    mantissa_bits = counts
    np.bitwise_and(float_bits, np.uint32(0x7FFFFF), out=mantissa_bits)
    mantissa_bits |= np.uint32(0x3F800000)
    np.greater_equal(mantissa_bits, _SQRT2_BITS, out=high)
    mantissa = mantissa_bits.view(_F)
    np.multiply(high, _F(0.5), out=scratch)
    np.subtract(_F(1.0), scratch, out=scratch)
    mantissa *= scratch
    float_bits >>= np.uint32(23)  # the biased exponent
    np.copyto(term, float_bits, casting="unsafe")
    term -= _F(127 + 24)
    term += high
    term *= _LN2  # exponent ln 2
    np.add(mantissa, _F(1.0), out=scratch)
    mantissa -= _F(1.0)
    mantissa /= scratch  # s = (m - 1) / (m + 1)
    np.multiply(mantissa, mantissa, out=scratch)
    _polynomial_into(scratch, _LOG_SERIES, out)
    out *= mantissa
    out += term
    return out


def standard_normal(key: int, positions: np.ndarray, out: np.ndarray | None = None, workspace: Workspace | None = None) -> np.ndarray:
    """N(0, 1) float32 values of the stream at ``positions`` (Box-Muller, one element each),
    flat, written into ``out`` if given (float32, ``positions``' size)."""
    n = positions.size
    workspace = workspace if workspace is not None else Workspace(n)
    z, shifted, low, word, float_bits, scratch, term, high = workspace.views(n)
    radius = out if out is not None else np.empty(n, _F)
    _bits_into(key, positions, z, shifted)
    np.copyto(low, z, casting="unsafe")  # the low 32 bits
    z >>= np.uint64(40)
    np.copyto(word, z, casting="unsafe")
    word += np.uint32(1)  # the high 24 bits + 1: a count in [1, 2^24]
    _log_of_counts_into(word, radius, float_bits, scratch, term, high)
    radius *= _F(-2.0)
    np.maximum(radius, _F(0.0), out=radius)
    np.sqrt(radius, out=radius)
    np.bitwise_and(low, np.uint32(0x7FFFFF), out=word)
    np.copyto(scratch, word, casting="unsafe")
    scratch *= _QUARTER_TURN
    scratch *= scratch
    radius *= _polynomial_into(scratch, _COS_SERIES, term)
    low <<= np.uint32(8)  # bit 23, the sign, to bit 31
    low &= np.uint32(0x80000000)
    radius.view(np.uint32)[...] |= low
    return radius


def uniform(key: int, positions: np.ndarray, out: np.ndarray | None = None, workspace: Workspace | None = None) -> np.ndarray:
    """Uniform [0, 1) float32 values of the stream at ``positions``, flat, written into ``out``
    if given (float32, ``positions``' size)."""
    n = positions.size
    workspace = workspace if workspace is not None else Workspace(n)
    z, shifted, _, word, *_ = workspace.views(n)
    values = out if out is not None else np.empty(n, _F)
    _bits_into(key, positions, z, shifted)
    z >>= np.uint64(40)
    np.copyto(word, z, casting="unsafe")
    np.copyto(values, word, casting="unsafe")
    values *= _F(2.0**-24)
    return values
