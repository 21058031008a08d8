"""Tests of ``megatron_bitpipe.optimizers``: the optimizers and learning-rate schedules, alone and in training."""
