"""Tests of ``megatron_bitpipe.optimus``: Optimus 2D tensor parallelism."""
