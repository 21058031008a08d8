"""Pretraining on megatron-core alone: the loop behind ``scripts/pretrain_gpt.py`` and
``scripts/pretrain_bert.py``.

* :mod:`.script` — :func:`~.script.run_script`, the scripts' entry point: check the flags (every
  rank, before any communication, before torch.distributed and megatron-core are imported);
  :mod:`.loop` — then the model-agnostic loop (:func:`~.loop.run_training`, :class:`~.loop.Trainer`;
  the run's decisions: :class:`megatron_bitpipe.run_config.RunConfig`);
* :mod:`.task` — :class:`~.task.PretrainTask`, what a model family brings (flags, datasets,
  checkpoint rules); :mod:`.model_kind` — :class:`~.model_kind.ModelKind`, one model of a task
  (chunks, layer spec, forward step, loss reports, p2p shapes); :mod:`.model_registry` — the
  kinds by name and the run's choice; :mod:`.gpt` — :class:`~.gpt.GPTTask`, its kinds, data and
  loss; :mod:`.bert` — :class:`~.bert.BertTask`, its kinds, data and loss; :mod:`.model` — the
  model from the common flags;
* :mod:`.mode` — what a data-parallel mode does in the loop (:class:`~.mode.DataParallelStrategy`);
  :mod:`.sync`, :mod:`.abs_sgd` and :mod:`.decentralized` — the modes; :mod:`.mode_registry` —
  the strategies by mode name and the resume of a mode's saved state;
* :mod:`.arguments` — Megatron-LM's flags and their checks;
* :mod:`.config` — megatron-core configs (model, DDP, optimizer — Adam or one of
  :mod:`megatron_bitpipe.optimizers` —, learning-rate schedule); :mod:`.optimizer` — the
  optimizer of a pipeline model (a fused array's too);
* :mod:`.schedule` — BitPipe or megatron-core's own schedules on the model's groups;
* :mod:`.data` — tokenizers, Megatron indexed datasets, global-batch order, micro-batches;
  :mod:`.preprocess` — text to Megatron indexed datasets (``scripts/preprocess_data.py``)
  and the built-in corpus;
* :mod:`.checkpoint` — megatron-core distributed checkpoints (Megatron-LM's contents) that any
  layout loads (whether a checkpoint can be loaded: :mod:`megatron_bitpipe.checkpoint_checks`,
  shared with the Megatron-LM routes); :mod:`.optimizer_state` — optimizer state across optimizer kinds;
* :mod:`.logs` — Megatron-style lines, JSON lines, TensorBoard; :mod:`.distributed` —
  torch.distributed start-up under torchrun or alone;
* :mod:`.exit_conditions` — Megatron-LM's early exits (signal, time budget, interval).

See ``docs/running.md`` and ``docs/checkpoints.md``.
"""

import importlib

__all__ = ["run_script", "PretrainTask"]

#: public name -> the submodule defining it, imported on first use: the scripts parse their
#: flags (:mod:`.arguments`, :mod:`.script`) before torch and megatron-core are imported
_SUBMODULE = {"run_script": "script", "PretrainTask": "task"}


def __getattr__(name: str):
    if name not in _SUBMODULE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_SUBMODULE[name]}"), name)
