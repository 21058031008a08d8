"""The model side: megatron-core model chunks for any placement, built from explicit process
groups and initialised from the seed alone.

* :mod:`.build` — one call from a config to a trainable pipeline model: groups, chunks,
  weights, DDP (:func:`~.build.build_pipeline_model`).
* :mod:`.layout` — which layers, embedding and head each local chunk holds; global <-> local
  parameter names (pure Python).
* :mod:`.chunks` — model chunks with explicit global layer ranges, tied embeddings on one
  rank; GPTModel chunks. :mod:`.bert_model` — BERT chunks (megatron-core's BertModel).
* :mod:`.init`, :mod:`.seeded_random` — initial weights from the seed and each parameter's
  full name, independent of the parallel layout.
* :mod:`.kernels` — which fused kernels a config turns on; :mod:`.norms` — a torch norm for
  megatron's local spec; :mod:`.sdpa_attention` — torch SDPA as core attention;
  :mod:`.precision` — bf16 / fp16 wrapping.
* :mod:`.sharded_state` — each chunk's distributed-checkpoint view: the single-process names,
  replicas and the tied head written once.

:mod:`megatron_bitpipe.execution` runs plans on these chunks.
"""
