"""Tests of ``megatron_bitpipe.benchmarking`` and the benchmark scripts."""
