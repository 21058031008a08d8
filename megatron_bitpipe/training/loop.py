"""The model-agnostic pretraining loop behind ``scripts/pretrain_gpt.py`` (and BERT's).

:func:`run_training` takes the checked flags (:mod:`.script` parses them on every rank,
before any communication), makes the run's decisions once
(:class:`~megatron_bitpipe.run_config.RunConfig`), builds the tokenizer, starts ``torch.distributed`` (:mod:`.distributed`),
asks the :class:`~.task.PretrainTask` for the model and the datasets, reports them (parameters,
memory, model FLOPs) and trains ``--train-iters`` iterations with the schedule the flags select
(:mod:`.schedule`): evaluation every ``--eval-interval`` iterations, logs (:mod:`.logs`),
checkpoints every ``--save-interval`` and at the end (:mod:`.checkpoint`), resuming from
``--load``. After the last iteration: the final validation, the test set where there is one,
and a summary. Megatron-LM's early exits (:mod:`.exit_conditions`: ``--exit-signal-handler``,
``--exit-duration-in-mins``, ``--exit-interval``) end the loop after an iteration, with a
checkpoint when ``--save`` is given and exit status 0; a run resumed from that checkpoint
continues the same loss curve.

One iteration: zero the gradient buffers, run the forward_backward function on this
data-parallel rank's micro-batches of the global batch, step the optimizer (grad norm and
clipping over each logical parameter once) and, if the update happened, the learning-rate
schedule by ``--global-batch-size`` samples. Loss reports live on the loss ranks (the last
pipeline stage; BitPipe's edge ranks); they are summed over the job so every rank holds the
global-batch loss.

With ``--data-parallel-mode abs-sgd`` an iteration is ABS-SGD's instead
(:class:`~.abs_sgd.step.AbsSgdStep`: it applies the previous iteration's gradients while
this one's all-reduce overlaps the next compute); its state travels with the checkpoints.
With ``decentlam``, ``dmsgd`` or ``lsgd`` the optimizer's step exchanges parameters between
the data-parallel replicas, which keep weights of their own
(:class:`~.decentralized.step.DecentralizedStep`: LSGD's losses, logs, the evaluated weights
and every replica's state in the checkpoints).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..optimizers import averaged_weights, lr_for_logging
from ..run_config import RunConfig
from .optimizer import build_optimizer
from . import distributed
from .arguments import padded_vocab_size
from .abs_sgd.step import AbsSgdStep, resume_data_parallel
from .decentralized.args import DECENTRALIZED_MODES
from .decentralized.step import DecentralizedStep, resume_decentralized
from .checkpoint import TrainingState, checkpoint_dir, load_checkpoint, save_checkpoint
from .config import lr_scheduler, optimizer_config, use_global_tp_group
from .data import build_tokenizer, microbatches
from .exit_conditions import ExitConditions
from .logs import IterationRecord, TrainingLogger
from .report import gather_rank_reports, job_peak_memory_mib, memory_kind, model_flops_per_sample, reset_peak_memory
from .schedule import Schedule
from .task import PretrainTask

__all__ = ["run_training", "Trainer"]


class Trainer:
    """The state of one training job on this rank; built by :meth:`build`."""

    def __init__(self, task: PretrainTask, args: argparse.Namespace, run: RunConfig, tokenizer, env: distributed.Distributed):
        self.started = time.perf_counter()  # the summary's total time: set-up and training
        self.task, self.args, self.run_config, self.env = task, args, run, env
        self.model = task.build_model(args, run)
        self.groups = self.model.groups
        use_global_tp_group(self.groups.tp)
        self.optimizer = build_optimizer(self.model, optimizer_config(args, run), run.optimizer)
        self.scheduler = lr_scheduler(args, run, self.optimizer)
        self.schedule = Schedule(args, run, self.model, self.optimizer, task)
        self.state = TrainingState()
        loaded = None
        if args.load:
            with averaged_weights(self.optimizer):  # checkpoints hold Schedule-Free's averaged weights
                loaded = load_checkpoint(args.load, self.model, self.optimizer, self.scheduler, args, task)
            self.state = loaded or self.state
        self.train_data, self.valid_data, self.test_data = task.build_datasets(args, tokenizer)
        self.abs_sgd = AbsSgdStep(self) if run.data_parallel_mode == "abs-sgd" else None
        self.decentralized = DecentralizedStep(self) if run.data_parallel_mode in DECENTRALIZED_MODES else None
        if loaded is not None:
            directory = checkpoint_dir(args.load, loaded.iteration)
            resume_decentralized(directory, self.decentralized)
            resume_data_parallel(directory, self.abs_sgd)
        self.logger = TrainingLogger(args, env.rank, resumed=self.state.iteration > 0)
        self.flops_per_iteration = args.global_batch_size * model_flops_per_sample(args, task.causal_attention)
        self.logger.startup(gather_rank_reports(self.model, env.device), memory_kind(env.device), self.flops_per_iteration, run.label)

    # -- one step -------------------------------------------------------------------------

    def _reduce_losses(self, reports: Sequence[Dict[str, torch.Tensor]]) -> Dict[str, float]:
        """``sum / count`` of each loss over the global batch (a collective over the job).

        Each loss rank adds its reports; only TP rank 0 of a stage contributes, as every TP
        rank of a loss stage holds the same reports.
        """
        names = self.task.loss_names
        totals = torch.zeros(len(names), 2, dtype=torch.float64, device=self.env.device)
        if self.groups.tp_rank == 0:
            for report in reports:
                for i, name in enumerate(names):
                    totals[i] += report[name].detach().to(totals)
        dist.all_reduce(totals)
        return {name: (totals[i, 0] / totals[i, 1].clamp(min=1)).item() for i, name in enumerate(names)}

    def _synchronize(self) -> None:
        if self.env.device.type == "cuda":
            torch.cuda.synchronize()

    def train_step(self) -> IterationRecord:
        if self.abs_sgd is not None:
            return self.abs_sgd.train_step()
        args = self.args
        self._synchronize()
        reset_peak_memory(self.env.device)
        start = time.perf_counter()
        for chunk in self.model.chunks:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        lr = lr_for_logging(self.optimizer)
        batches = microbatches(self.train_data, self.state.consumed_train_samples, args, self.groups.dp_rank)
        reports = self.schedule.run(self.task.forward_step, batches, forward_only=False)
        if self.decentralized is not None:
            self.decentralized.observe(reports)
        success, grad_norm, _ = self.optimizer.step()
        if success:
            self.scheduler.step(increment=args.global_batch_size)
        losses, extra = self.task.iteration_losses(self._reduce_losses(reports))
        self._synchronize()
        elapsed = time.perf_counter() - start
        self.state.iteration += 1
        self.state.consumed_train_samples += args.global_batch_size
        if args.optimizer == "onebit_lamb" and self.state.iteration == args.onebit_freeze_iters:
            distributed.log(
                f"1-bit LAMB: variance frozen after iteration {self.state.iteration}; from now on momenta are averaged "
                "with 1-bit compression instead of all-reducing gradients (--clip-grad no longer applies)"
            )
        on_gpu = self.env.device.type == "cuda"
        return IterationRecord(
            iteration=self.state.iteration,
            consumed_samples=self.state.consumed_train_samples,
            elapsed_ms=1000.0 * elapsed,
            tokens_per_second=args.global_batch_size * args.seq_length / elapsed,
            lr=float(lr),
            grad_norm=None if grad_norm is None else float(grad_norm),
            loss_scale=float(self.optimizer.get_loss_scale()),
            skipped=not success,
            losses=losses,
            max_memory_mib=job_peak_memory_mib(self.env.device),
            tflops_per_device=self.flops_per_iteration / (elapsed * self.env.world_size * 1e12) if on_gpu else None,
            extra=extra if self.decentralized is None else {**extra, **self.decentralized.fields(self.state.iteration)},
        )

    def evaluate(self, dataset=None) -> Dict[str, float]:
        """Mean losses over the first ``--eval-iters`` global batches of ``dataset`` (default:
        the validation set), of Schedule-Free's averaged weights with that optimizer, of the
        decentralized modes' evaluated weights (the replicas' average, LSGD's global leader)."""
        dataset = self.valid_data if dataset is None else dataset
        for chunk in self.model.chunks:
            chunk.eval()
        reports: List[dict] = []
        evaluated = contextlib.nullcontext() if self.decentralized is None else self.decentralized.evaluated_weights()
        with torch.no_grad(), averaged_weights(self.optimizer), evaluated:
            for batch in range(self.args.eval_iters):
                first = batch * self.args.global_batch_size
                batches = microbatches(dataset, first, self.args, self.groups.dp_rank)
                reports += self.schedule.run(self.task.forward_step, batches, forward_only=True)
        for chunk in self.model.chunks:
            chunk.train()
        return self._reduce_losses(reports)

    # -- the loop -------------------------------------------------------------------------

    def _due(self, interval: Optional[int]) -> bool:
        return bool(interval) and self.state.iteration % interval == 0

    def save(self) -> None:
        if self.abs_sgd is not None:
            self.abs_sgd.save(checkpoint_dir(self.args.save, self.state.iteration))
        if self.decentralized is not None:
            self.decentralized.save(checkpoint_dir(self.args.save, self.state.iteration))
        with averaged_weights(self.optimizer):  # Schedule-Free saves its averaged weights
            directory = save_checkpoint(self.args.save, self.state, self.model, self.optimizer, self.scheduler, self.args, self.task)
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
        self.logger.final_evaluation(label, self.args.eval_iters, time.perf_counter() - started)
        return losses

    def train(self, exits: ExitConditions) -> None:
        """Train to ``--train-iters`` or until one of ``exits`` says stop; save at the end
        unless this iteration was just saved."""
        args = self.args
        stopped = False
        saved = first = self.state.iteration  # nothing new to save unless an iteration runs
        started, validation = time.perf_counter(), {}
        while self.state.iteration < args.train_iters:
            record = self.train_step()
            if self.valid_data is not None and self._due(args.eval_interval):
                record.validation = self.evaluate()
                if self.decentralized is not None:
                    record.extra["evaluated_weights"] = self.decentralized.evaluated_label()
            self.logger.record(record)
            validation = record.validation
            if args.save and self._due(args.save_interval):
                self.save()
                saved = self.state.iteration
            reason = exits.reason(self.state.iteration, self.env.device)
            if reason is not None:
                self.logger.finish_interval()
                after = "saving and exiting" if args.save else "exiting without a checkpoint (no --save)"
                distributed.log(f"stopping after iteration {self.state.iteration} of {args.train_iters}: {reason}; {after}")
                stopped = True
                break
        if args.save and saved != self.state.iteration:
            self.save()
        if self.abs_sgd is not None:
            self.abs_sgd.finish()
        self.finish(first, started, validation, evaluate=not stopped)
        self.logger.close()


def run_training(task: PretrainTask, args: argparse.Namespace, *, cpu_fallback: Optional[Callable[[], None]] = None) -> None:
    """Train ``task`` with the parsed and checked flags ``args`` (:func:`.arguments.parse_args`).

    Run on every rank of the job (torchrun) or alone. ``cpu_fallback`` is called when there
    is no GPU (the scripts pass the CPU compatibility layer). ``--exit-signal-handler``'s
    handler is in place from here to the end of training, and ``--exit-duration-in-mins``
    counts from here. Raises CheckpointError for a checkpoint that does not fit (before
    anything is loaded).
    """
    run = RunConfig.from_args(args)
    with ExitConditions(args, time.time()) as exits:
        tokenizer = build_tokenizer(args)
        args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, args)
        env = distributed.initialize(args, cpu_fallback)
        layout, batches = run.layout, run.batches
        distributed.log(
            f"{task.name}: {run.label} schedule, TP {layout.tensor} ({layout.tensor_parallel_mode}) x "
            f"PP {layout.pipeline} x DP {layout.data}, {batches.num_microbatches} micro-batches "
            f"of {batches.micro_batch_size} per data-parallel rank, padded vocabulary {args.padded_vocab_size}"
        )
        Trainer(task, args, run, tokenizer, env).train(exits)
    dist.destroy_process_group()

