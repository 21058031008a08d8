"""The execution side: running schedule plans on model chunks.

* :mod:`.group_plan` — the rank grid and the group plan: every process group of a layout
  (names, rank lists, creation and warm-up order) as data, without communication.
* :mod:`.groups` — the process groups created from the plan: megatron-core collections per
  chunk, p2p channel groups, grad-sync groups, warmed up in the plan's order.
* :mod:`.executor` — one rank's part of a plan: compute, point-to-point messages, eager
  gradient syncs, the overlapped F+B pairs.
* :mod:`.forward_backward` — megatron-core ``forward_backward_func`` implementations that
  execute plans.
* :mod:`.weight_grad` — the split backward through megatron-core's weight-gradient deferral
  contract (``delay_wgrad_compute``, ``backward_dw``).
* :mod:`.replicas` — per-chunk DDP over the replicas, loss divisor, grad-norm marking,
  replica checks.
* :mod:`.distributed_optimizer` — megatron-core's distributed optimizer per chunk, over its
  grad-sync group, checkpointed as one optimizer.

The chunks come from :mod:`megatron_bitpipe.model`.
"""
