"""Megatron-LM integration: the plugin inside Megatron-LM's own training loop (tag core_v0.16.1).

* :mod:`.checkout` — find a Megatron-LM checkout (``MEGATRON_LM_PATH``) and check its version
  (pure Python);
* :mod:`.args` — the plugin's flags on Megatron-LM's parser and the rules of its training loop;
* :mod:`.hooks` — the functions Megatron-LM calls (flags, checks and schedule, model, batch)
  and :func:`~.hooks.install`, the runtime route of ``python -m megatron_bitpipe.run``;
* :mod:`.model` — BitPipe's V chunks built by the script's own ``model_provider``;
  seed-only initial weights;
* :mod:`.losses` — the BitPipe forward_backward_func whose loss reports reach the last
  pipeline stage, where Megatron-LM averages them.

Only :mod:`.checkout` may be imported before the checkout is on ``sys.path``; the other
modules import ``megatron.core`` and (when called) ``megatron.training``.
"""
