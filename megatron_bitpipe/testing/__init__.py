"""Test-only helpers; nothing outside ``tests/`` imports this package.

* :mod:`.weights` — map chunk parameters to full-model names (layout-independent weights);
* :mod:`.fp32_cross_entropy` — fp32 gradients from megatron's native fused cross entropy.
"""
