"""One run's decisions, made once from the parsed flags: :class:`RunConfig`.

Both routes parse Megatron-LM's flag names — this package's scripts
(:func:`megatron_bitpipe.training.arguments.parse_args`) and Megatron-LM's own parser with
:func:`~megatron_bitpipe.megatron_args.add_bitpipe_args` — and both make one
:class:`RunConfig` from the checked namespace with :meth:`RunConfig.from_args`. It holds the
decisions made from the flags, each made once here: the resolved
:class:`~megatron_bitpipe.schedules.ScheduleChoice` (``--pipeline-schedule default`` already
resolved to megatron-core's choice, ``--schedule-costs`` read), who runs it (megatron-core's
forward_backward function or this package's plan executor), the parallel layout, the
layers of each pipeline stage (:class:`~megatron_bitpipe.schedules.layer_split.StageLayers` of
Megatron-LM's uneven-layout flags), the mixture of experts, the precision, the batch shape, the
data-parallel mode, the optimizer choice, the layers' kernels, checkpointing, logging, the
process group's backend and, on this package's scripts, which build the tokenizer first, the
padded vocabulary. Everything downstream of the parser takes the :class:`RunConfig` for these
decisions and nothing writes to the namespace once it exists; the model's
hyper-parameters (layers, hidden size, ...) stay Megatron-LM's namespace fields, read in one
place per consumer (the ``TransformerConfig`` builder).

Pure Python (torch only for :attr:`Precision.dtype`), no communication: made on every rank
before ``torch.distributed`` starts.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import Optional, Tuple

from .data_parallel_modes import DataParallelMode, selected_mode
from .hfta.settings import HftaSettings, hfta_settings
from .megatron_args import schedule_choice
from .moe_settings import MoESettings, moe_settings
from .optimizers import OptimizerChoice
from .schedules import REGISTRY, ScheduleChoice
from .schedules.layer_split import LayerSplitFlags, StageLayers, split_layers, split_problems
from .schedules.placement import Placement

__all__ = ["Batches", "Checkpointing", "Kernels", "Logging", "ParallelLayout", "Precision", "RunConfig", "padded_vocab_size"]


def padded_vocab_size(vocab_size: int, args: argparse.Namespace) -> int:
    """``vocab_size`` rounded up to a multiple of lcm(``--make-vocab-size-divisible-by``, TP size)
    (Megatron-LM's rule: every tensor-parallel rank holds an equal slice of the embedding)."""
    multiple = math.lcm(args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    return -(-vocab_size // multiple) * multiple


@dataclass(frozen=True)
class ParallelLayout:
    """How the job's ranks are split.

    Invariant: ``world == tensor * pipeline * data``.

    Attributes:
        tensor: tensor-parallel size (``--tensor-model-parallel-size``; Optimus 2D: ``q * q``).
        pipeline: pipeline-parallel size ``D`` (``--pipeline-model-parallel-size``).
        data: data-parallel size (replicas of each model chunk; BitPipe's two weight replicas
            are not counted here).
        virtual: chunks per rank of megatron-core's interleaved schedule; ``None`` otherwise.
        sequence_parallel: megatron's sequence parallelism (off with TP 1).
        tensor_parallel_mode: ``1d`` (megatron's) or ``optimus2d`` (SUMMA).
        expert: expert-parallel size (``--expert-model-parallel-size``): each MoE layer's
            experts split over that many consecutive data-parallel ranks; divides ``data``.
    """

    tensor: int
    pipeline: int
    data: int
    virtual: Optional[int]
    sequence_parallel: bool
    tensor_parallel_mode: str
    expert: int = 1

    @property
    def world(self) -> int:
        return self.tensor * self.pipeline * self.data


@dataclass(frozen=True)
class Precision:
    """Weights' and activations' precision (``--bf16`` / ``--fp16``; fp32 otherwise). With bf16
    or fp16 the optimizer keeps fp32 main weights."""

    bf16: bool = False
    fp16: bool = False

    @property
    def name(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    @property
    def dtype(self):
        """The ``torch.dtype`` of the model's parameters and pipeline messages."""
        import torch

        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.name]


@dataclass(frozen=True)
class Batches:
    """The shape of one iteration, in samples.

    Invariant: ``global_batch_size == micro_batch_size * num_microbatches * data-parallel size``.

    Attributes:
        micro_batch_size: samples per micro-batch.
        global_batch_size: samples per iteration over the job.
        num_microbatches: micro-batches per data-parallel rank and iteration (the schedule's N).
        seq_length: tokens per sample (``--seq-length``).
    """

    micro_batch_size: int
    global_batch_size: int
    num_microbatches: int
    seq_length: Optional[int] = None


@dataclass(frozen=True)
class Kernels:
    """Which implementations the model's layers use.

    Attributes:
        transformer_impl: ``--transformer-impl`` (``transformer_engine`` or ``local``); None:
            Transformer Engine where it runs the run's layers, else local.
        attention_backend: ``--attention-backend``: ``auto`` (the layer spec's own core
            attention), ``local`` or ``sdpa`` (torch's scaled dot-product attention in local layers).
            On Megatron-LM's route its own ``AttnBackend`` member (its model builders read it).
    """

    transformer_impl: Optional[str] = None
    attention_backend: str = "auto"


@dataclass(frozen=True)
class Checkpointing:
    """Where the run saves and what it takes from the checkpoint it resumes.

    Attributes:
        save: ``--save``, the directory checkpoints are written under (None: no checkpoints).
        save_interval: ``--save-interval``, iterations between checkpoints (None: at the end only).
        load: ``--load``, the directory resumed from (None: a fresh start).
        finetune: ``--finetune``: the weights only, from iteration 0.
        no_load_optim: ``--no-load-optim``: the weights and progress without the optimizer state.
    """

    save: Optional[str] = None
    save_interval: Optional[int] = None
    load: Optional[str] = None
    finetune: bool = False
    no_load_optim: bool = False

    @property
    def weights_only(self) -> bool:
        """Whether a resume leaves the optimizer state (and what rides with it) fresh."""
        return self.finetune or self.no_load_optim


@dataclass(frozen=True)
class Logging:
    """What the training logs write, and how often.

    Attributes:
        interval: ``--log-interval``, iterations per log line.
        json_path: ``--log-json``, the JSON-lines event file (None: none).
        tensorboard_dir: ``--tensorboard-dir`` (None: no TensorBoard events).
    """

    interval: int = 100
    json_path: Optional[str] = None
    tensorboard_dir: Optional[str] = None


@dataclass(frozen=True)
class RunConfig:
    """The decisions of one run (see the module docstring).

    Attributes:
        schedule: the pipeline schedule that runs, resolved (never ``default``).
        layout: the parallel layout.
        precision: fp32, bf16 or fp16.
        batches: the batch shape.
        data_parallel_mode: ``--data-parallel-mode``, the registered mode
            (:mod:`~megatron_bitpipe.data_parallel_modes`; ``sync`` on Megatron-LM's route).
        optimizer: ``--optimizer`` and its flags (``decentralized`` with a decentralized
            data-parallel mode: its step is the mode's update).
        schedule_costs_path: the ``--schedule-costs`` file the split's plan is made for (logs name it).
        hfta: the fused array of ``--hfta-models`` (None: one model).
        moe: the mixture-of-experts choice of ``--num-experts`` and its flags
            (:class:`~megatron_bitpipe.moe_settings.MoESettings`; None: a dense model).
        distributed_optimizer: ``--use-distributed-optimizer`` (optimizer state sharded over
            data parallelism; with a plan-executed schedule one distributed optimizer per chunk).
        layout_independent_init: ``--layout-independent-init`` (Megatron-LM's route: its own
            chunks are re-initialised from ``--seed`` and each weight's full-model name). This
            package's chunk builder, which builds the chunks of a plan-executed schedule and every
            chunk of its own scripts, always initialises that way.
        overlap_grad_reduce: gradients are reduced during the backward, by bucket: always with a
            plan-executed schedule (its eager per-chunk reduction), with megatron-core's
            schedules when ``--overlap-grad-reduce`` is given.
        overlap_p2p_comm: ``--overlap-p2p-comm`` where the schedule overlaps its pipeline
            messages (the plan executor's and megatron-core's interleaved schedule); off otherwise.
        replica_slowdown: ``--emulate-replica-slowdown``: one factor per data-parallel replica
            its compute time is stretched by (benchmarks), or None.
        stage_layers: the transformer layers of each stage of a pipeline of :attr:`placement`, in
            pipeline order (:mod:`~megatron_bitpipe.schedules.layer_split`: equal stages, or
            what ``--decoder-first/last-pipeline-num-layers``, ``--account-for-*-in-pipeline-split``
            or ``--pipeline-model-parallel-layout`` ask for); None without ``--num-layers`` and
            where the flags do not split this placement's stages (Megatron-LM's route, whose own
            schedules' chunks megatron-core builds and checks).
        padded_vocab_size: the embedding's rows: the tokenizer's vocabulary padded by
            :func:`padded_vocab_size`; None where the RunConfig is made without the tokenizer
            (Megatron-LM's route, where Megatron-LM builds the tokenizer and pads its vocabulary
            into its own namespace).
        kernels: the layers' implementations (``--transformer-impl``, ``--attention-backend``).
        checkpointing: ``--save``, ``--load`` and what a resume takes.
        logging: the log interval and files.
        distributed_backend: ``--distributed-backend``, the process group's backend (``nccl``,
            ``gloo``; this package's scripts default it to ``nccl`` with a GPU, else ``gloo``).
    """

    schedule: ScheduleChoice
    layout: ParallelLayout
    precision: Precision
    batches: Batches
    data_parallel_mode: DataParallelMode
    optimizer: OptimizerChoice
    schedule_costs_path: Optional[str] = None
    hfta: Optional[HftaSettings] = None
    moe: Optional[MoESettings] = None
    distributed_optimizer: bool = False
    layout_independent_init: bool = False
    overlap_grad_reduce: bool = False
    overlap_p2p_comm: bool = False
    replica_slowdown: Optional[Tuple[float, ...]] = None
    stage_layers: Optional[StageLayers] = None
    padded_vocab_size: Optional[int] = None
    kernels: Kernels = Kernels()
    checkpointing: Checkpointing = Checkpointing()
    logging: Logging = Logging()
    distributed_backend: Optional[str] = None

    @property
    def executes_plan(self) -> bool:
        """Whether this package's plan executor runs the schedule (else megatron-core's functions):
        the registry's word (:attr:`~megatron_bitpipe.schedules.ScheduleChoice.plan_executed`)."""
        return self.schedule.plan_executed

    @property
    def weight_replicas(self) -> int:
        """Copies of the model's weights the schedule's placement holds on the pipeline ranks
        (2 for BitPipe's bidirectional V, 1 for megatron-core's looped schedules)."""
        return self.placement.num_pipelines

    @property
    def megatron_schedule(self) -> Optional[str]:
        """megatron-core's forward_backward function that runs the schedule: ``no_pipelining``
        (one pipeline stage), ``1f1b`` or ``interleaved``; ``None`` when the plan executor runs it."""
        if self.executes_plan:
            return None
        return "no_pipelining" if self.layout.pipeline == 1 else self.schedule.schedule

    @property
    def label(self) -> str:
        """The schedule as the logs name it: the plan's label (``bitpipe+split-backward``) with
        its cost file, megatron-core's schedule with its chunks per rank."""
        if self.executes_plan:
            costs = f" (costs from {self.schedule_costs_path})" if self.schedule_costs_path else ""
            return self.schedule.label + costs
        if self.megatron_schedule == "interleaved":
            return f"interleaved ({self.schedule.virtual_chunks} chunks per rank)"
        return self.megatron_schedule

    @property
    def schedule_name(self) -> str:
        """What runs, in one word: ``no_pipelining``, ``1f1b`` or ``interleaved`` (megatron-core's
        functions), else the plan-executed schedule's name (``bitpipe``)."""
        return self.megatron_schedule or self.schedule.schedule

    @property
    def placement(self) -> Placement:
        """Where the schedule's stages live on the pipeline ranks."""
        return self.schedule.placement(self.layout.pipeline)

    @classmethod
    def from_args(cls, args: argparse.Namespace, vocab_size: Optional[int] = None) -> "RunConfig":
        """The decisions of checked flags (either route's namespace; the data-parallel size and
        the batch sizes as Megatron-LM derives them) and of the tokenizer's ``vocab_size`` (None:
        no tokenizer, no :attr:`padded_vocab_size`). Reads the ``--schedule-costs`` file."""
        schedule = schedule_choice(args)
        interleaved = REGISTRY[schedule.schedule].takes_virtual_size
        slowdown = getattr(args, "emulate_replica_slowdown", None)  # flags of this package's scripts only
        tensor, pipeline = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        data = args.data_parallel_size
        data_parallel_mode = selected_mode(args)
        return cls(
            schedule=schedule,
            layout=ParallelLayout(
                tensor=tensor,
                pipeline=pipeline,
                data=data,
                virtual=schedule.virtual_chunks if interleaved else None,
                sequence_parallel=bool(args.sequence_parallel) and tensor > 1,
                tensor_parallel_mode=getattr(args, "tensor_parallel_mode", "1d"),
                expert=getattr(args, "expert_model_parallel_size", 1),
            ),
            precision=Precision(bf16=bool(args.bf16), fp16=bool(args.fp16)),
            batches=Batches(
                micro_batch_size=args.micro_batch_size,
                global_batch_size=args.global_batch_size,
                num_microbatches=args.global_batch_size // (args.micro_batch_size * data),
                seq_length=getattr(args, "seq_length", None),
            ),
            data_parallel_mode=data_parallel_mode,
            optimizer=replace(OptimizerChoice.from_args(args), decentralized=data_parallel_mode.decentralized),
            schedule_costs_path=getattr(args, "schedule_costs", None) if schedule.uses_costs else None,
            hfta=hfta_settings(args),
            moe=moe_settings(args),
            distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
            layout_independent_init=bool(getattr(args, "layout_independent_init", False)),
            overlap_grad_reduce=schedule.plan_executed or bool(getattr(args, "overlap_grad_reduce", False)),
            overlap_p2p_comm=bool(getattr(args, "overlap_p2p_comm", False)) and (schedule.plan_executed or interleaved),
            replica_slowdown=None if slowdown is None else tuple(slowdown),
            stage_layers=_stage_layers(args, schedule.placement(pipeline)),
            padded_vocab_size=None if vocab_size is None else padded_vocab_size(vocab_size, args),
            kernels=Kernels(
                transformer_impl=getattr(args, "transformer_impl", None),
                attention_backend=getattr(args, "attention_backend", "auto"),
            ),
            checkpointing=Checkpointing(
                save=getattr(args, "save", None),
                save_interval=getattr(args, "save_interval", None),
                load=getattr(args, "load", None),
                finetune=bool(getattr(args, "finetune", False)),
                no_load_optim=bool(getattr(args, "no_load_optim", False)),
            ),
            logging=Logging(
                interval=getattr(args, "log_interval", 100),
                json_path=getattr(args, "log_json", None),
                tensorboard_dir=getattr(args, "tensorboard_dir", None),
            ),
            distributed_backend=getattr(args, "distributed_backend", None),
        )


def _stage_layers(args: argparse.Namespace, placement: Placement) -> Optional[StageLayers]:
    """:attr:`RunConfig.stage_layers` of the flags (None where they give no split)."""
    num_layers = getattr(args, "num_layers", None)
    flags = LayerSplitFlags.from_args(args)
    if num_layers is None or split_problems(flags, placement, num_layers):
        return None
    return split_layers(flags, placement, num_layers)
