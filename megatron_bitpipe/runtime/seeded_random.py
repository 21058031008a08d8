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

__all__ = ["stream_key", "bits", "standard_normal", "uniform"]

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


def bits(key: int, positions: np.ndarray) -> np.ndarray:
    """The stream's 64-bit elements at ``positions`` (a non-negative integer array)."""
    z = positions.astype(np.uint64, copy=True)
    shifted = np.empty_like(z)
    z += np.uint64(1)
    z *= _GAMMA
    z += np.uint64(key)
    for shift, multiplier in ((30, _MIX1), (27, _MIX2), (31, None)):
        np.right_shift(z, np.uint64(shift), out=shifted)
        z ^= shifted
        if multiplier is not None:
            z *= multiplier
    return z


def _polynomial(x: np.ndarray, coefficients) -> np.ndarray:
    """Horner: ``coefficients`` (highest power first) evaluated at ``x``."""
    result = x * coefficients[0]
    result += coefficients[1]
    for c in coefficients[2:]:
        result *= x
        result += c
    return result


def _log_of_counts(counts: np.ndarray) -> np.ndarray:
    """``ln(counts / 2^24)`` for ``uint32`` integers ``counts`` in [1, 2^24] (float32)."""
    # counts = m 2^e exactly: e and m read off the float32 bits, m in [1, 2), then moved to
    # [sqrt(1/2), sqrt(2))
    float_bits = counts.astype(_F).view(np.uint32)
    mantissa_bits = (float_bits & np.uint32(0x7FFFFF)) | np.uint32(0x3F800000)
    high = mantissa_bits >= _SQRT2_BITS
    mantissa = mantissa_bits.view(_F)
    mantissa *= _F(1.0) - _F(0.5) * high
    exponent = (float_bits >> np.uint32(23)).astype(np.int32) - (127 + 24) + high
    s = mantissa - _F(1.0)
    s /= mantissa + _F(1.0)
    result = _polynomial(s * s, _LOG_SERIES)
    result *= s
    result += exponent.astype(_F) * _LN2
    return result


def standard_normal(key: int, positions: np.ndarray) -> np.ndarray:
    """N(0, 1) float32 values of the stream at ``positions`` (Box-Muller, one element each)."""
    z = bits(key, positions)
    high, low = (z >> np.uint64(32)).astype(np.uint32), z.astype(np.uint32)
    radius = _log_of_counts((high >> np.uint32(8)) + np.uint32(1))
    radius *= _F(-2.0)
    np.maximum(radius, _F(0.0), out=radius)
    np.sqrt(radius, out=radius)
    t = (low & np.uint32(0x7FFFFF)).astype(_F)
    t *= _QUARTER_TURN
    radius *= _polynomial(t * t, _COS_SERIES)
    sign = (low >> np.uint32(23)) & np.uint32(1)
    sign <<= np.uint32(31)
    radius.view(np.uint32)[...] |= sign
    return radius


def uniform(key: int, positions: np.ndarray) -> np.ndarray:
    """Uniform [0, 1) float32 values of the stream at ``positions``."""
    return ((bits(key, positions) >> np.uint64(40)).astype(np.uint32).astype(_F)) * _F(2.0**-24)
