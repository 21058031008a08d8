"""Tests of ``megatron_bitpipe.execution``: the plan executor, split backward, the distributed optimizer and recompute under it, each against single-process training."""
