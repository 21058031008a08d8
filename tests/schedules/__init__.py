"""Tests of ``megatron_bitpipe.schedules``: plans, the simulator and its cost and memory models, the NCCL model, lowering, the layout search, the command line."""
