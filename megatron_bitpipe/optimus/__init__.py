"""Optimus 2D (SUMMA) tensor parallelism for megatron-core: ``--tensor-parallel-mode optimus2d``."""
