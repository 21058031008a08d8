"""Tests of ``megatron_bitpipe.hfta``: fused arrays of GPTs and BERTs."""
