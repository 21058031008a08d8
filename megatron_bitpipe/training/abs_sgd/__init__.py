"""ABS-SGD: delayed, adaptive-batch data parallelism for heterogeneous clusters.

``--data-parallel-mode abs-sgd`` (Zhou, Chen and Wu, 2023): every data-parallel replica
``i`` computes ``G_i``, the sum of its micro-batches' gradients, over the ``n_i``
micro-batches its speed allows, while the all-reduce of the previous iteration's ``(G, n)``
runs; the update applies that previous, one-iteration-stale gradient exactly normalised,
``w_{k+1} = w_k - update(sum_i G_i^{k-1} / sum_i n_i^{k-1})``, with any optimizer (clipping
and the learning-rate schedule see this gradient; the schedule advances by its samples).
Fast replicas do more micro-batches, nobody waits for the slowest.

* :mod:`.args` — flags (``--abs-*``, ``--emulate-replica-slowdown``)
  and their rules;
* :mod:`.counts` — per-replica sample streams and the planned counts (pure Python);
* :mod:`.exchange` — the asynchronous all-reduce of one iteration's gradient sums and
  statistics;
* :mod:`.step` — the mode's strategy in the training loop: the iteration, logs and checkpoints.

See ``docs/heterogeneous.md``.
"""

from .args import AbsSgdSettings, abs_sgd_problems, add_abs_sgd_args, train_samples_of

# .step (the loop's side) is imported by the strategies' registry (training.mode_registry):
# it needs the data module, which needs .args.
__all__ = ["AbsSgdSettings", "abs_sgd_problems", "add_abs_sgd_args", "train_samples_of"]
