"""Tests of ``megatron_bitpipe.megatron_lm`` and ``run.py``: Megatron-LM's own training through the plugin and patch routes."""
