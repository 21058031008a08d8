"""Running one global batch with the schedule the flags select.

==========================  ======================================================  ==================
``RunConfig.schedule_name``  forward_backward function                              placement
==========================  ======================================================  ==================
bitpipe                     :func:`~megatron_bitpipe.execution.forward_backward.make_forward_backward_func`  bidirectional V
                            of the run's :class:`~megatron_bitpipe.schedules.ScheduleChoice` (``--split-backward``,
                            ``--schedule-costs``)
no_pipelining               megatron-core ``forward_backward_no_pipelining``         looped, 1 rank
1f1b                        megatron-core ``forward_backward_pipelining_without_interleaving``  looped
interleaved                 megatron-core ``forward_backward_pipelining_with_interleaving``  looped, v chunks
==========================  ======================================================  ==================

megatron-core's schedules get the model's explicit process groups (``pg_collection`` and a
``P2PCommunicator`` over the pipeline group) and read the hooks Megatron-LM installs on the
model config: ``finalize_model_grads_func`` (data-parallel reduction, tied-embedding
all-reduce; with Optimus 2D also the column sums of :mod:`megatron_bitpipe.optimus.grads`),
``grad_scale_func`` (fp16 loss scaling) and, with ``--overlap-grad-reduce``, ``no_sync_func``. BitPipe's function needs none of them (its chunks carry their groups).
With ``--overlap-param-gather`` a gather the optimizer step did not start is started before
megatron-core's schedule runs, in stage order, as the plan executor does
(:func:`~megatron_bitpipe.execution.forward_backward.start_param_gathers`).

With ``--emulate-replica-slowdown`` every training call on a rank of data-parallel replica
``r`` is followed by ``(F_r - 1)`` times its duration of emulated compute
(:class:`~megatron_bitpipe.benchmarking.emulation.ReplicaSlowdown`); evaluation is not slowed.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, List, Optional

from megatron.core.pipeline_parallel import schedules as megatron_schedules
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from ..optimus.grads import finalize_model_grads_func
from ..run_config import RunConfig
from ..model.build import PipelineModel
from ..execution.forward_backward import make_forward_backward_func, start_param_gathers

__all__ = ["Schedule"]

_MEGATRON_FUNCTIONS = {
    "no_pipelining": megatron_schedules.forward_backward_no_pipelining,
    "1f1b": megatron_schedules.forward_backward_pipelining_without_interleaving,
    "interleaved": megatron_schedules.forward_backward_pipelining_with_interleaving,
}


class Schedule:
    """The forward_backward function of ``run``'s schedule bound to ``model``.

    Installs the config hooks (see the module docstring) on ``model.config``, the config
    every DDP chunk reports. ``adjust_tensor_shapes_fn`` is the model kind's pipeline p2p
    shapes (:attr:`~.model_kind.ModelKind.p2p_shapes`; None: megatron's ``[s, b, h]``).
    """

    def __init__(self, run: RunConfig, model: PipelineModel, optimizer, adjust_tensor_shapes_fn: Optional[Callable]):
        self.run_config = run
        self.model = model
        megatron_schedule = run.megatron_schedule
        if megatron_schedule is None:
            self.function = make_forward_backward_func(run.schedule)
        else:
            self.function = _MEGATRON_FUNCTIONS[megatron_schedule]
        config = model.config
        config.finalize_model_grads_func = finalize_model_grads_func(model.groups.mesh)
        config.grad_scale_func = optimizer.scale_loss
        if run.overlap_grad_reduce and megatron_schedule is not None:
            no_sync = [chunk.no_sync for chunk in model.chunks]
            config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        self.kwargs: Dict[str, object] = {}
        if megatron_schedule is not None:
            self.kwargs["pg_collection"] = model.groups.rank_pgs
        if megatron_schedule in ("1f1b", "interleaved"):
            self.kwargs["p2p_communicator"] = P2PCommunicator(model.groups.pp, config)
        if megatron_schedule != "no_pipelining":
            self.kwargs["adjust_tensor_shapes_fn"] = adjust_tensor_shapes_fn
        self.slowdown = None
        if run.replica_slowdown is not None:
            from ..benchmarking.emulation import ReplicaSlowdown

            self.slowdown = ReplicaSlowdown(run.replica_slowdown[model.groups.dp_rank])

    def run(self, forward_step_func: Callable, batches: List[dict], forward_only: bool) -> List[dict]:
        """Forward (and backward) of this data-parallel rank's micro-batches; the loss
        reports of the micro-batches whose loss this rank computes."""
        if self.run_config.megatron_schedule == "interleaved":
            data_iterator = [iter(batches) for _ in self.model.chunks]  # each chunk reads every micro-batch
        else:
            data_iterator = iter(batches)
        if self.run_config.megatron_schedule is not None:
            start_param_gathers(self.model.chunks, self.model.groups)
        started = time.perf_counter()
        reports = self.function(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=self.model.chunks,
            num_microbatches=len(batches),
            seq_length=self.run_config.batches.seq_length,
            micro_batch_size=self.run_config.batches.micro_batch_size,
            forward_only=forward_only,
            **self.kwargs,
        )
        if self.slowdown is not None and not forward_only:
            self.slowdown.after(started)
        return reports
