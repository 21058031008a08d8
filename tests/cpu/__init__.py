"""Tests of ``megatron_bitpipe.cpu``: the CPU/gloo compatibility layer, strict p2p, the device audit, quiet logs."""
