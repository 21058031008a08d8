"""The model-agnostic pretraining loop behind ``scripts/pretrain_gpt.py`` (and BERT's).

:func:`run_training` takes the checked flags (:mod:`.script` parses them on every rank,
before any communication), builds the tokenizer, makes the run's decisions once
(:class:`~megatron_bitpipe.run_config.RunConfig`, with the tokenizer's padded vocabulary), starts ``torch.distributed`` (:mod:`.distributed`),
builds the model of the run's model kind (chosen once, :func:`~.model_registry.model_kind_for`),
asks the :class:`~.task.PretrainTask` for the datasets, reports them (parameters,
memory, model FLOPs) and trains ``--train-iters`` iterations with the schedule the flags select
(:mod:`.schedule`): evaluation every ``--eval-interval`` iterations, logs (:mod:`.logs`),
checkpoints every ``--save-interval`` and at the end (:mod:`.checkpoint`), resuming from
``--load``. After the last iteration: the final validation, the test set where there is one,
and a summary. Megatron-LM's early exits (:mod:`.exit_conditions`: ``--exit-signal-handler``,
``--exit-duration-in-mins``, ``--exit-interval``) end the loop after an iteration, with a
checkpoint when ``--save`` is given and exit status 0; a run resumed from that checkpoint
continues the same loss curve.

An iteration is the ``--data-parallel-mode``'s (:class:`~.mode.DataParallelStrategy`, built
from :mod:`.mode_registry`): megatron's synchronous one by default (:class:`~.sync.SyncStrategy`),
ABS-SGD's (:class:`~.abs_sgd.step.AbsSgdStrategy`: it applies the previous iteration's
gradients while this one's all-reduce overlaps the next compute) or a decentralized mode's
(:class:`~.decentralized.step.DecentralizedStrategy`: the replicas keep weights of their own).
The strategy also chooses the weights evaluation uses, adds its log fields and keeps its state
next to the checkpoints. Loss reports live on the loss ranks (the last pipeline stage;
BitPipe's edge ranks); they are summed over the job so every rank holds the global-batch loss.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ..optimizers import averaged_weights
from ..usage import reader_gone
from ..run_config import RunConfig, TokenizerSettings
from .optimizer import build_optimizer
from . import distributed
from .checkpoint import TrainingState, checkpoint_dir, load_checkpoint, save_checkpoint
from .config import lr_scheduler, optimizer_config, use_global_tp_group
from .data import build_tokenizer, microbatches
from .exit_conditions import ExitConditions
from .faults import FaultInjection, job_restart
from .logs import IterationRecord, TrainingLogger
from .mode import TrainingParts, reduce_losses
from .mode_registry import build_strategy, resume_mode
from .model_registry import model_kind_for
from .report import gather_rank_reports, memory_kind, model_flops_per_iteration
from .schedule import Schedule
from .straggler import ForwardTimer, StragglerDetector
from .task import PretrainTask
from .watchdog import Watchdog

__all__ = ["run_training", "Trainer"]


class Trainer:
    """The state of one training job on this rank; built by :meth:`build`."""

    def __init__(self, task: PretrainTask, args: argparse.Namespace, run: RunConfig, tokenizer, env: distributed.Distributed):
        self.started = time.perf_counter()  # the summary's total time: set-up and training
        self.task, self.args, self.run_config, self.env = task, args, run, env
        self.kind = model_kind_for(task.name, run)
        self.loss_names = self.kind.loss_names(run)
        self.forward_step = self.kind.forward_step(run)
        self.model = self.kind.build_model(run)
        self.groups = self.model.groups
        use_global_tp_group(self.groups.tp)
        self.optimizer = build_optimizer(self.model, optimizer_config(run), run.optimizer, run.hfta)
        self.scheduler = lr_scheduler(run, self.optimizer)
        self.schedule = Schedule(run, self.model, self.optimizer, self.kind.p2p_shapes(run, self.model))
        self.state = TrainingState()
        loaded = None
        if run.checkpointing.load:
            with averaged_weights(self.optimizer):  # checkpoints hold Schedule-Free's averaged weights
                loaded = load_checkpoint(run.checkpointing.load, self.model, self.optimizer, self.scheduler, args, run, task)
            self.state = loaded or self.state
        self.train_data, self.valid_data, self.test_data = task.build_datasets(run, tokenizer)
        models = 1 if run.hfta is None else run.hfta.num_models
        self.flops_per_iteration = model_flops_per_iteration(run, self.kind.causal_attention, models)
        #: the ``--inject-fault`` of this rank (none on the other ranks, and in a restarted job)
        self.fault = FaultInjection.from_args(args, env.rank, job_restart(os.environ))
        #: this rank's forward-step time per iteration, and the stragglers among the ranks (multi-rank
        #: jobs whose replicas step together: the gather is a collective over all ranks)
        self.forward_timer = ForwardTimer(env.device) if env.world_size > 1 and run.data_parallel_mode.lockstep else None
        self.stragglers = StragglerDetector()
        #: ends the job when a rank hangs or dies inside the loop (set by :meth:`train`)
        self.watchdog: Optional[Watchdog] = None
        parts = TrainingParts(
            args=args,
            run=run,
            env=env,
            kind=self.kind,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            schedule=self.schedule,
            train_data=self.train_data,
            state=self.state,
            flops_per_iteration=self.flops_per_iteration,
            wrap_forward_step=self._training_forward_step,
        )
        #: the data-parallel mode's strategy: the iteration, evaluated weights, log fields, saved state
        self.data_parallel = build_strategy(run.data_parallel_mode, parts)
        if loaded is not None:
            resume_mode(checkpoint_dir(run.checkpointing.load, loaded.iteration), self.data_parallel)
        self.logger = TrainingLogger(run, args.train_iters, env.rank, resumed=self.state.iteration > 0)
        self.logger.startup(
            gather_rank_reports(self.model, env.device),
            memory_kind(env.device),
            self.flops_per_iteration,
            run.label,
            models,
            stage_layers=run.stage_layers.counts if run.stage_layers is not None else None,
        )

    # -- one step -------------------------------------------------------------------------

    def _training_forward_step(self, forward_step: Callable) -> Callable:
        """The training forward step: slowed by an injected ``slow`` fault, timed per rank."""
        forward_step = self.fault.slowed(forward_step, lambda: self.state.iteration + 1)
        return forward_step if self.forward_timer is None else self.forward_timer.wrap(forward_step)

    def _at(self, iteration: int, phase: str) -> None:
        if self.watchdog is not None:
            self.watchdog.at(iteration, phase)

    def train_step(self) -> IterationRecord:
        """One iteration of the data-parallel mode (collective), with the per-rank forward
        times (``forward_ms_per_rank``) and the straggler report of a multi-rank job."""
        iteration = self.state.iteration + 1
        self._at(iteration, "training step")
        self.fault.before_step(iteration)
        record = self.data_parallel.train_step()
        if self.forward_timer is not None:
            times = self.forward_timer.gather(self.env.world_size)
            record.forward_ms_per_rank = [round(t, 2) for t in times]
            line = self.stragglers.add(record.iteration, times)
            if line is not None:
                distributed.log(line)
        return record

    def evaluate(self, dataset=None) -> Dict[str, float]:
        """Mean losses over the first ``--eval-iters`` global batches of ``dataset`` (default:
        the validation set), of Schedule-Free's averaged weights with that optimizer, of the
        data-parallel mode's evaluated weights (the decentralized modes: the replicas' average,
        LSGD's global leader)."""
        dataset = self.valid_data if dataset is None else dataset
        for chunk in self.model.chunks:
            chunk.eval()
        reports: List[dict] = []
        with torch.no_grad(), averaged_weights(self.optimizer), self.data_parallel.evaluated_weights():
            for batch in range(self.run_config.data.eval_iters):
                first = batch * self.run_config.batches.global_batch_size
                batches = microbatches(dataset, first, self.run_config, self.groups.dp_rank)
                reports += self.schedule.run(self.forward_step, batches, forward_only=True)
        for chunk in self.model.chunks:
            chunk.train()
        return reduce_losses(reports, self.loss_names, self.groups.tp_rank, self.env.device)

    # -- the loop -------------------------------------------------------------------------

    def _due(self, interval: Optional[int]) -> bool:
        return bool(interval) and self.state.iteration % interval == 0

    def save(self) -> None:
        iteration = self.state.iteration
        self._at(iteration, "checkpoint save")
        root = self.run_config.checkpointing.save
        self.data_parallel.save(checkpoint_dir(root, iteration))
        with averaged_weights(self.optimizer):  # Schedule-Free saves its averaged weights
            directory = save_checkpoint(
                root, self.state, self.model, self.optimizer, self.scheduler, self.args, self.run_config, self.task,
                shards_written=lambda: self.fault.during_save(iteration),
            )
        distributed.log(f"saved checkpoint {directory} at iteration {self.state.iteration}")

    def finish(self, first_iteration: int, train_started: float, validation: Dict[str, float], evaluate: bool = True) -> None:
        """After the last iteration: the final validation (``validation``, if the last
        iteration was evaluated, else evaluated now), the test set's evaluation where there is
        one, and the summary. ``evaluate=False`` (an early exit): the summary only."""
        iteration, train_time = self.state.iteration, time.perf_counter() - train_started
        if not evaluate:
            self.logger.summary(iteration, iteration - first_iteration, time.perf_counter() - self.started, train_time, validation, {})
            return
        if self.valid_data is not None and not validation:
            validation = self._final_evaluation("validation set")
            self.logger.evaluation(f"iteration {iteration} on validation set", validation)
        test = {}
        if self.test_data is not None:
            test = self._final_evaluation("test set", self.test_data)
            self.logger.evaluation(f"iteration {iteration} on test set", test)
        total_time = time.perf_counter() - self.started
        self.logger.summary(iteration, iteration - first_iteration, total_time, train_time, validation, test)

    def _final_evaluation(self, label: str, dataset=None) -> Dict[str, float]:
        """:meth:`evaluate` after the last iteration, its cost logged (it can outlast a short run)."""
        started = time.perf_counter()
        losses = self.evaluate(dataset)
        self.logger.final_evaluation(label, self.run_config.data.eval_iters, time.perf_counter() - started)
        return losses

    def train(self, exits: ExitConditions, watchdog: Optional[Watchdog] = None) -> None:
        """Train to ``--train-iters`` or until one of ``exits`` says stop; save at the end
        unless this iteration was just saved. ``watchdog`` (multi-rank jobs) runs meanwhile and
        ends the job when a rank hangs or a communication fails."""
        self.watchdog = watchdog
        with watchdog if watchdog is not None else contextlib.nullcontext():
            try:
                self._train(exits)
            except Exception as error:
                if watchdog is not None and not reader_gone():
                    watchdog.failed(error)  # a communication error: reports and ends the job
                raise

    def _train(self, exits: ExitConditions) -> None:
        args, checkpointing = self.args, self.run_config.checkpointing
        stopped = False
        saved = first = self.state.iteration  # nothing new to save unless an iteration runs
        started, validation = time.perf_counter(), {}
        while self.state.iteration < args.train_iters:
            record = self.train_step()
            if self.valid_data is not None and self._due(self.run_config.data.eval_interval):
                self._at(self.state.iteration, "evaluation")
                record.validation = self.evaluate()
                record.extra.update(self.data_parallel.evaluation_fields())
            self.logger.record(record)
            validation = record.validation
            if checkpointing.save and self._due(checkpointing.save_interval):
                self.save()
                saved = self.state.iteration
            reason = exits.reason(self.state.iteration, self.env.device)
            if reason is not None:
                self.logger.finish_interval()
                after = "saving and exiting" if checkpointing.save else "exiting without a checkpoint (no --save)"
                distributed.log(f"stopping after iteration {self.state.iteration} of {args.train_iters}: {reason}; {after}")
                stopped = True
                break
        if checkpointing.save and saved != self.state.iteration:
            self.save()
        self._at(self.state.iteration, "the end of training")
        self.data_parallel.finish()
        self.finish(first, started, validation, evaluate=not stopped)
        self.logger.close()


def run_training(task: PretrainTask, args: argparse.Namespace, *, cpu_fallback: Optional[Callable[[], Optional[torch.device]]] = None) -> None:
    """Train ``task`` with the parsed and checked flags ``args`` (:func:`.arguments.parse_args`).

    Run on every rank of the job (torchrun) or alone. ``cpu_fallback`` is called when there
    is no GPU (the scripts pass the CPU compatibility layer). ``--exit-signal-handler``'s
    handler is in place from the run's decisions (the tokenizer built) to the end of training,
    and ``--exit-duration-in-mins`` counts from the call. Raises CheckpointError for a checkpoint that does not fit (before
    anything is loaded).
    """
    started = time.time()
    tokenizer = build_tokenizer(TokenizerSettings.from_args(args))
    run = RunConfig.from_args(args, tokenizer.vocab_size, task)
    with ExitConditions(run.exits, started) as exits:
        env = distributed.initialize(run, cpu_fallback)
        layout, batches = run.layout, run.batches
        distributed.log(
            f"{task.name}: {run.label} schedule, TP {layout.tensor} ({layout.tensor_parallel_mode}) x "
            f"PP {layout.pipeline} x DP {layout.data}{f' x CP {layout.context}' if layout.context > 1 else ''}, "
            f"{batches.num_microbatches} micro-batches "
            f"of {batches.micro_batch_size} per data-parallel rank, padded vocabulary {run.padded_vocab_size}"
        )
        trainer = Trainer(task, args, run, tokenizer, env)
        trainer.train(exits, Watchdog.for_job(env.rank, env.world_size, 60.0 * run.distributed_timeout_minutes))
    dist.destroy_process_group()

