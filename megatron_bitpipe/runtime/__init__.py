"""Running placements on megatron-core: chunks, process groups, initial weights, replicas.

* :mod:`.layout` — which layers, embedding and head each local chunk holds; global <-> local
  parameter names (pure Python).
* :mod:`.groups` — the rank grid and every process group: megatron-core collections per
  chunk, p2p channel groups, grad-sync groups.
* :mod:`.model` — model chunks with explicit global layer ranges, tied embeddings on one rank;
  GPTModel chunks.
* :mod:`.bert` — BERT chunks (megatron-core's BertModel built from explicit process groups).
* :mod:`.init` — initial weights from the seed alone, independent of the parallel layout.
* :mod:`.replicas` — per-chunk DDP over the replicas, loss divisor, grad-norm marking,
  replica checks.
* :mod:`.distributed_optimizer` — megatron-core's distributed optimizer per chunk, over its
  grad-sync group, checkpointed as one optimizer.
* :mod:`.sharded_state` — each chunk's distributed-checkpoint view: the single-process names,
  replicas and the tied head written once.
"""
