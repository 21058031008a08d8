"""What the benchmarks in ``scripts/`` measure with.

* :mod:`.emulation` — transformer layers whose compute is emulated time (the emulated
  cluster of ``scripts/bench_emulated.py``);
* :mod:`.meters` — saved-activation, live-activation and collective meters;
* :mod:`.megatron_baseline` — megatron-core's stock GPTModel on megatron's looped placement
  with megatron's own schedules: the baseline of the benchmarks and the reference of the
  equivalence tests.

Nothing in the library imports this package.
"""
