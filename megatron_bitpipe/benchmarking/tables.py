"""Cells of the benchmarks' markdown tables (``scripts/bench_*.py``)."""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

__all__ = ["mean_and_range"]


def mean_and_range(values: Sequence[Optional[float]], digits: int, absent: str = "—", count_absent: Optional[str] = None) -> str:
    """``mean (min–max)`` of the values that are not None, ``digits`` decimals (just the mean
    for one value); ``absent`` when none is. With ``count_absent`` the missing ones are
    counted after it: ``2.5 (2.0–3.0), 1 not reached``."""
    present = [v for v in values if v is not None]
    if not present:
        return absent
    text = f"{statistics.mean(present):.{digits}f}"
    if len(present) > 1:
        text += f" ({min(present):.{digits}f}–{max(present):.{digits}f})"
    if count_absent is not None and len(present) < len(values):
        text += f", {len(values) - len(present)} {count_absent}"
    return text
