"""megatron-bitpipe: BitPipe pipeline schedule and Optimus 2D tensor parallelism for megatron-core.

* ``register(schedule="bitpipe")`` — make megatron-core's (and Megatron-LM's)
  ``get_forward_backward_func`` return the BitPipe schedule (:mod:`.plugin`);
* ``add_bitpipe_args`` / ``validate_bitpipe_args`` — the command-line flags
  (:mod:`.megatron_args`);
* :mod:`.schedules` — schedules as data, simulator, command line (no torch needed);
* :mod:`.model` — model chunks for any placement (built, initialised from the seed);
  :mod:`.execution` — running plans on them;
* :mod:`.run_config` — a run's decisions, made once from the flags;
* :mod:`.optimus` — Optimus 2D (SUMMA) tensor parallelism;
* :mod:`.megatron_lm` and ``python -m megatron_bitpipe.run`` (:mod:`.run`) — the plugin inside
  Megatron-LM's own training scripts (docs/megatron_lm.md).

Importing this package is cheap: torch and megatron-core are imported by the submodules
that need them.
"""

__version__ = "0.1.0"


def register(schedule: str = "bitpipe", *, plan_func=None) -> None:
    """See :func:`megatron_bitpipe.plugin.register`."""
    from .plugin import register as _register

    _register(schedule, plan_func=plan_func)


def unregister() -> None:
    """See :func:`megatron_bitpipe.plugin.unregister`."""
    from .plugin import unregister as _unregister

    _unregister()


def add_bitpipe_args(parser):
    """See :func:`megatron_bitpipe.megatron_args.add_bitpipe_args`."""
    from .megatron_args import add_bitpipe_args as _add

    return _add(parser)


def validate_bitpipe_args(args):
    """See :func:`megatron_bitpipe.megatron_args.validate_bitpipe_args`."""
    from .megatron_args import validate_bitpipe_args as _validate

    return _validate(args)
