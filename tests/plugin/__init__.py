"""Tests of ``plugin.py`` and ``megatron_args.py``: registration with megatron-core and the flags' rules."""
