"""Test and demo support; production code never imports this package.

* :mod:`.launcher` — run a function on N gloo ranks (CPU processes).
* :mod:`.cpu_compat` — let megatron-core run on a CPU-only torch.
* :mod:`.gpt` — tiny megatron-core GPT models, process groups, DDP and optimizer.
* :mod:`.weights` — map chunk parameters to full-model names (layout-independent weights).
* :mod:`.measure` — saved-activation and collective meters for benchmarks.
* :mod:`.emulation` — transformer layers whose compute is emulated time (the emulated cluster).
"""
