"""Tests of ``megatron_bitpipe.training`` and the pretraining scripts: flags, the data-parallel modes, model kinds, checkpoints, faults, logs, coresets, SLURM."""
