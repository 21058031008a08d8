"""Pretraining on megatron-core alone: the loop behind ``scripts/pretrain_gpt.py`` and
``scripts/pretrain_bert.py``.

* :mod:`.loop` — :func:`~.loop.main` / :func:`~.loop.pretrain`: check the flags (every rank,
  before any communication), then run the model-agnostic loop (:class:`~.loop.Trainer`);
* :mod:`.task` — :class:`~.task.PretrainTask`, what a model brings (provider, forward step,
  datasets); :mod:`.gpt` — :class:`~.gpt.GPTTask`, its model, data and loss;
  :mod:`.bert` — :class:`~.bert.BertTask`, its data and loss; :mod:`.model` — the model from the common flags;
* :mod:`.arguments` — Megatron-LM's flags and their checks;
* :mod:`.config` — megatron-core configs (model, DDP, optimizer — Adam or one of
  :mod:`megatron_bitpipe.optimizers` —, learning-rate schedule);
* :mod:`.schedule` — BitPipe or megatron-core's own schedules on the model's groups;
* :mod:`.data` — tokenizers, Megatron indexed datasets, global-batch order, micro-batches;
  :mod:`.preprocess` — text to Megatron indexed datasets (``scripts/preprocess_data.py``)
  and the built-in corpus;
* :mod:`.checkpoint` — layout-independent checkpoints; :mod:`.sharding` — full tensors
  from the TP blocks (1-D and Optimus 2D);
* :mod:`.logs` — Megatron-style lines, JSON lines, TensorBoard; :mod:`.distributed` —
  torch.distributed start-up under torchrun or alone;
* :mod:`.exit_conditions` — Megatron-LM's early exits (signal, time budget, interval).

See ``docs/running.md`` and ``docs/checkpoints.md``.
"""

from .loop import main, pretrain
from .task import PretrainTask

__all__ = ["main", "pretrain", "PretrainTask"]
