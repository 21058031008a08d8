"""Tests of ``megatron_bitpipe.model`` and ``model_partition.py``: chunks, seed initialisation, SDPA attention, mixture-of-experts layers, BERT, parameter names."""
