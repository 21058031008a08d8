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
decisions and nothing writes to the namespace once it exists. The model's sizes are the
simulator's :class:`~megatron_bitpipe.schedules.model_shape.ModelShape` (one class and one set of
rules for training, the simulator, ``layout-search`` and ``recommend``); recomputation, the
optimizer's hyper-parameters and the learning-rate schedule are typed sub-configs too.

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
from .schedules.model_shape import ModelShape
from .schedules.moe_shape import MoEShape
from .schedules.placement import Placement

__all__ = [
    "Batches",
    "Checkpointing",
    "DataSettings",
    "Exits",
    "Kernels",
    "LearningRateSchedule",
    "Logging",
    "OptimizerSettings",
    "ParallelLayout",
    "Precision",
    "Recompute",
    "RunConfig",
    "TokenizerSettings",
    "model_shape_of",
    "padded_vocab_size",
]


def padded_vocab_size(vocab_size: int, args: argparse.Namespace) -> int:
    """``vocab_size`` rounded up to a multiple of lcm(``--make-vocab-size-divisible-by``, TP size)
    (Megatron-LM's rule: every tensor-parallel rank holds an equal slice of the embedding)."""
    multiple = math.lcm(args.make_vocab_size_divisible_by, args.tensor_model_parallel_size)
    return -(-vocab_size // multiple) * multiple


def _context_comm(value) -> str:
    """``--cp-comm-type`` as one name: this package's scripts hold a string, Megatron-LM's
    namespace a list (one name for every layer, or one per layer); None means ``all_gather``.
    ValueError for a per-layer list of more than one name (not supported)."""
    if value is None or isinstance(value, str):
        return value or "all_gather"
    names = list(value)
    if len(names) != 1:
        raise ValueError(f"--cp-comm-type takes one value for every layer here (got {' '.join(names)})")
    return names[0]


@dataclass(frozen=True)
class ParallelLayout:
    """How the job's ranks are split.

    Invariant: ``world == tensor * context * pipeline * data``.

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
        context: context-parallel size (``--context-parallel-size``): ranks splitting each
            sequence of a data-parallel replica (:mod:`megatron_bitpipe.model.context_parallel`).
        context_comm: how context-parallel attention exchanges keys and values
            (``--cp-comm-type``, megatron's names): ``all_gather`` or ``p2p`` (the ring,
            :mod:`megatron_bitpipe.model.ring_attention`); read only at ``context`` > 1.
    """

    tensor: int
    pipeline: int
    data: int
    virtual: Optional[int]
    sequence_parallel: bool
    tensor_parallel_mode: str
    expert: int = 1
    context: int = 1
    context_comm: str = "all_gather"

    @property
    def world(self) -> int:
        return self.tensor * self.context * self.pipeline * self.data


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
        cross_entropy_loss_fusion: ``--cross-entropy-loss-fusion`` (megatron-core's fused cross
            entropy, whose ``native`` kernel rounds the logits' gradient to bf16).
        cross_entropy_fusion_impl: ``--cross-entropy-fusion-impl``, ``native`` or ``te``.
    """

    transformer_impl: Optional[str] = None
    attention_backend: str = "auto"
    cross_entropy_loss_fusion: bool = False
    cross_entropy_fusion_impl: str = "native"


@dataclass(frozen=True)
class Recompute:
    """Activation recomputation, megatron-core's fields (``--recompute-granularity`` ``full`` or
    ``selective``, None: none; ``--recompute-method`` ``uniform`` or ``block`` and
    ``--recompute-num-layers`` with ``full``; ``--recompute-modules`` with ``selective``)."""

    granularity: Optional[str] = None
    method: Optional[str] = None
    num_layers: Optional[int] = None
    modules: Optional[Tuple[str, ...]] = None


@dataclass(frozen=True)
class OptimizerSettings:
    """The values megatron's ``OptimizerConfig`` takes from Megatron-LM's flags (the choice of
    optimizer is :class:`~megatron_bitpipe.optimizers.OptimizerChoice`).

    Attributes:
        lr, min_lr: ``--lr`` (the peak) and ``--min-lr`` (the floor of the decay).
        weight_decay: ``--weight-decay``.
        adam_beta1, adam_beta2, adam_eps: Adam's ``--adam-beta1/2`` and ``--adam-eps``.
        sgd_momentum: ``--sgd-momentum``.
        clip_grad: ``--clip-grad``, the global gradient norm clipped to (0: no clipping).
        loss_scale: ``--loss-scale``, a static fp16 loss scale (None: dynamic).
        initial_loss_scale: ``--initial-loss-scale``, where the dynamic fp16 scale starts.
    """

    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    loss_scale: Optional[float] = None
    initial_loss_scale: float = 2.0**32


@dataclass(frozen=True)
class LearningRateSchedule:
    """Megatron-LM's learning-rate schedule in iterations (the scheduler counts samples: each
    length times the global batch size).

    Attributes:
        warmup_iters: ``--lr-warmup-iters``.
        warmup_init: ``--lr-warmup-init``, the rate the warm-up starts from.
        decay_iters: ``--lr-decay-iters`` (default ``--train-iters``).
        decay_style: ``--lr-decay-style`` (``constant``, ``linear``, ``cosine``, ...; ``rex``).
        rex_beta: ``--rex-beta``, the REX schedule's shape.
        train_iters: ``--train-iters`` (the weight-decay schedule's length).
        use_checkpoint: ``--use-checkpoint-opt_param-scheduler``: a resume takes the saved schedule.
        override: ``--override-opt_param-scheduler``: a resume keeps the flags' schedule.
    """

    warmup_iters: int = 0
    warmup_init: float = 0.0
    decay_iters: Optional[int] = None
    decay_style: str = "linear"
    rex_beta: float = 0.9
    train_iters: Optional[int] = None
    use_checkpoint: bool = False
    override: bool = False


@dataclass(frozen=True)
class Checkpointing:
    """Where the run saves and what it takes from the checkpoint it resumes.

    Attributes:
        save: ``--save``, the directory checkpoints are written under (None: no checkpoints).
        save_interval: ``--save-interval``, iterations between checkpoints (None: at the end only).
        load: ``--load``, the directory resumed from (None: a fresh start).
        finetune: ``--finetune``: the weights only, from iteration 0.
        no_load_optim: ``--no-load-optim``: the weights and progress without the optimizer state.
        no_load_rng: ``--no-load-rng``: the random generators are not restored.
        save_optim: the optimizer state and learning-rate schedule are saved (not ``--no-save-optim``).
        save_rng: every rank's random generators are saved (not ``--no-save-rng``).
        step: ``--ckpt-step``, the iteration to load (None: the latest).
        exit_on_missing: ``--exit-on-missing-checkpoint``: a ``--load`` without a checkpoint
            stops the run instead of starting from iteration 0.
        schedule_unchecked: ``--override-opt_param-scheduler`` or
            ``--use-checkpoint-opt_param-scheduler``: the checkpoint's learning-rate schedule is
            not compared with this run's flags.
    """

    save: Optional[str] = None
    save_interval: Optional[int] = None
    load: Optional[str] = None
    finetune: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    save_optim: bool = True
    save_rng: bool = True
    step: Optional[int] = None
    exit_on_missing: bool = False
    schedule_unchecked: bool = False

    @property
    def weights_only(self) -> bool:
        """Whether a resume leaves the optimizer state (and what rides with it) fresh."""
        return self.finetune or self.no_load_optim


@dataclass(frozen=True)
class Exits:
    """When the run stops early (Megatron-LM's flags; None: never).

    Attributes:
        interval: ``--exit-interval``: after an iteration that is a multiple of it.
        duration_minutes: ``--exit-duration-in-mins``: once the job has run that long.
        signal: ``--exit-signal`` with ``--exit-signal-handler``: the signal's name
            (``SIGTERM``), after the iteration it arrives in.
    """

    interval: Optional[int] = None
    duration_minutes: Optional[float] = None
    signal: Optional[str] = None


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
class TokenizerSettings:
    """megatron-core's tokenizer, as Megatron-LM's flags name it.

    Attributes:
        tokenizer_type: ``--tokenizer-type`` (None: megatron-core's null tokenizer of
            ``vocab_size`` tokens plus end-of-document).
        vocab_file: ``--vocab-file``.
        merge_file: ``--merge-file``.
        tokenizer_model: ``--tokenizer-model``.
        vocab_size: ``--vocab-size`` (the null and byte-level tokenizers' size; None: theirs).
    """

    tokenizer_type: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    tokenizer_model: Optional[str] = None
    vocab_size: Optional[int] = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TokenizerSettings":
        """The tokenizer flags of either route's namespace (absent ones: None)."""
        return cls(**{name: getattr(args, name, None) for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class DataSettings:
    """Where a run's samples come from, and how many each split must hold.

    Attributes:
        paths: ``--data-path``, the blend as Megatron-LM writes it (prefixes, or weights and
            prefixes); empty: mock data.
        split: ``--split``, the train/validation/test shares of every dataset of the blend.
        cache_path: ``--data-cache-path`` (None: beside the data).
        eod_mask_loss: ``--eod-mask-loss``: no loss on end-of-document tokens.
        train_samples: samples the training set must hold for ``--train-iters`` iterations
            (``--train-iters`` x ``--global-batch-size``; ABS-SGD: as far as any replica's
            stream reaches, :func:`~megatron_bitpipe.training.abs_sgd.train_samples_of`).
        eval_iters: ``--eval-iters``, global batches per evaluation of the validation set and
            of the test set (0: neither is built).
        eval_interval: ``--eval-interval``, iterations between evaluations.
    """

    paths: Tuple[str, ...] = ()
    split: str = "969, 30, 1"
    cache_path: Optional[str] = None
    eod_mask_loss: bool = False
    train_samples: int = 0
    eval_iters: int = 0
    eval_interval: int = 1000

    @property
    def mock(self) -> bool:
        """Whether the samples are synthetic (no ``--data-path``)."""
        return not self.paths

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DataSettings":
        """The data flags of either route's namespace; ``train_samples`` as the flag check
        derived it (``dataset_train_samples``), else ``--train-iters`` x ``--global-batch-size``."""
        train_samples = getattr(args, "dataset_train_samples", None)
        if train_samples is None:
            train_samples = (getattr(args, "train_iters", None) or 0) * (getattr(args, "global_batch_size", None) or 0)
        return cls(
            paths=tuple(getattr(args, "data_path", None) or ()),
            split=getattr(args, "split", None) or cls.split,
            cache_path=getattr(args, "data_cache_path", None),
            eod_mask_loss=bool(getattr(args, "eod_mask_loss", False)),
            train_samples=train_samples,
            eval_iters=getattr(args, "eval_iters", 0) or 0,
            eval_interval=getattr(args, "eval_interval", None) or cls.eval_interval,
        )


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
        overlap_param_gather: ``--overlap-param-gather`` with ``--use-distributed-optimizer``: each
            chunk's parameter all-gather starts after its step and the next forward waits for it
            (:attr:`~megatron_bitpipe.execution.replicas.ChunkDistributedDataParallel.overlaps_param_gather`).
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
        model: the model's sizes (:class:`~megatron_bitpipe.schedules.model_shape.ModelShape`, the
            simulator's class and rules; its ``vocab_size`` the tokenizer's where known); None
            without ``--num-layers``.
        recompute: activation recomputation.
        data: where the samples come from and how many each split holds.
        tokenizer: the tokenizer the samples are read with.
        task_settings: the task's own decisions, typed by the task
            (:meth:`~megatron_bitpipe.training.task.TaskArguments.task_settings`: BERT's masking
            and binary head, GPT's coreset; None: a run made without its task, or a task
            without any).
        optimizer_settings: the optimizer's hyper-parameters.
        lr_schedule: the learning-rate schedule.
        seed: ``--seed``, what the initial weights (and the data order) are drawn from.
        exits: when the run stops early.
        distributed_timeout_minutes: ``--distributed-timeout-minutes``: the longest a rank waits
            for its peers before the job ends (the watchdog, and the process group's backstop).
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
    overlap_param_gather: bool = False
    overlap_p2p_comm: bool = False
    replica_slowdown: Optional[Tuple[float, ...]] = None
    stage_layers: Optional[StageLayers] = None
    padded_vocab_size: Optional[int] = None
    kernels: Kernels = Kernels()
    checkpointing: Checkpointing = Checkpointing()
    logging: Logging = Logging()
    distributed_backend: Optional[str] = None
    model: Optional[ModelShape] = None
    recompute: Recompute = Recompute()
    data: DataSettings = DataSettings()
    tokenizer: TokenizerSettings = TokenizerSettings()
    task_settings: object = None
    optimizer_settings: OptimizerSettings = OptimizerSettings()
    lr_schedule: LearningRateSchedule = LearningRateSchedule()
    seed: int = 1234
    exits: Exits = Exits()
    distributed_timeout_minutes: float = 10.0

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
    def from_args(cls, args: argparse.Namespace, vocab_size: Optional[int] = None, task=None) -> "RunConfig":
        """The decisions of checked flags (either route's namespace; the data-parallel size and
        the batch sizes as Megatron-LM derives them), of the tokenizer's ``vocab_size`` (None:
        no tokenizer, no :attr:`padded_vocab_size`) and of ``task``'s own flags (its
        :meth:`~megatron_bitpipe.training.task.TaskArguments.task_settings`; None: no task).
        Reads the ``--schedule-costs`` file."""
        schedule = schedule_choice(args)
        interleaved = REGISTRY[schedule.schedule].takes_virtual_size
        slowdown = getattr(args, "emulate_replica_slowdown", None)  # flags of this package's scripts only
        tensor, pipeline = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
        data = args.data_parallel_size
        data_parallel_mode = selected_mode(args)
        moe = moe_settings(args)
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
                context=getattr(args, "context_parallel_size", 1),
                context_comm=_context_comm(getattr(args, "cp_comm_type", None)),
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
            moe=moe,
            distributed_optimizer=bool(getattr(args, "use_distributed_optimizer", False)),
            layout_independent_init=bool(getattr(args, "layout_independent_init", False)),
            overlap_grad_reduce=schedule.plan_executed or bool(getattr(args, "overlap_grad_reduce", False)),
            overlap_param_gather=bool(getattr(args, "overlap_param_gather", False))
            and bool(getattr(args, "use_distributed_optimizer", False)),
            overlap_p2p_comm=bool(getattr(args, "overlap_p2p_comm", False)) and (schedule.plan_executed or interleaved),
            replica_slowdown=None if slowdown is None else tuple(slowdown),
            stage_layers=_stage_layers(args, schedule.placement(pipeline)),
            padded_vocab_size=None if vocab_size is None else padded_vocab_size(vocab_size, args),
            kernels=Kernels(
                transformer_impl=getattr(args, "transformer_impl", None),
                attention_backend=getattr(args, "attention_backend", "auto"),
                cross_entropy_loss_fusion=bool(getattr(args, "cross_entropy_loss_fusion", False)),
                cross_entropy_fusion_impl=getattr(args, "cross_entropy_fusion_impl", "native"),
            ),
            checkpointing=Checkpointing(
                save=getattr(args, "save", None),
                save_interval=getattr(args, "save_interval", None),
                load=getattr(args, "load", None),
                finetune=bool(getattr(args, "finetune", False)),
                no_load_optim=bool(getattr(args, "no_load_optim", False)),
                no_load_rng=bool(getattr(args, "no_load_rng", False)),
                save_optim=not getattr(args, "no_save_optim", False),
                save_rng=not getattr(args, "no_save_rng", False),
                step=getattr(args, "ckpt_step", None),
                exit_on_missing=bool(getattr(args, "exit_on_missing_checkpoint", False)),
                schedule_unchecked=bool(getattr(args, "override_opt_param_scheduler", False)
                                        or getattr(args, "use_checkpoint_opt_param_scheduler", False)),
            ),
            logging=Logging(
                interval=getattr(args, "log_interval", 100),
                json_path=getattr(args, "log_json", None),
                tensorboard_dir=getattr(args, "tensorboard_dir", None),
            ),
            distributed_backend=getattr(args, "distributed_backend", None),
            model=model_shape_of(args, vocab_size, moe),
            seed=getattr(args, "seed", 1234),
            exits=Exits(
                interval=getattr(args, "exit_interval", None),
                duration_minutes=getattr(args, "exit_duration_in_mins", None),
                signal=getattr(args, "exit_signal", None) if getattr(args, "exit_signal_handler", False) else None,
            ),
            distributed_timeout_minutes=getattr(args, "distributed_timeout_minutes", 10.0),
            recompute=Recompute(
                granularity=getattr(args, "recompute_granularity", None),
                method=getattr(args, "recompute_method", None),
                num_layers=getattr(args, "recompute_num_layers", None),
                modules=None if getattr(args, "recompute_modules", None) is None else tuple(args.recompute_modules),
            ),
            optimizer_settings=OptimizerSettings(
                **{name: getattr(args, name) for name in OptimizerSettings.__dataclass_fields__ if hasattr(args, name)}
            ),
            lr_schedule=LearningRateSchedule(
                warmup_iters=getattr(args, "lr_warmup_iters", 0) or 0,
                warmup_init=getattr(args, "lr_warmup_init", 0.0),
                decay_iters=getattr(args, "lr_decay_iters", None),
                decay_style=getattr(args, "lr_decay_style", "linear"),
                rex_beta=getattr(args, "rex_beta", 0.9),
                train_iters=getattr(args, "train_iters", None),
                use_checkpoint=bool(getattr(args, "use_checkpoint_opt_param_scheduler", False)),
                override=bool(getattr(args, "override_opt_param_scheduler", False)),
            ),
            data=DataSettings.from_args(args),
            tokenizer=TokenizerSettings.from_args(args),
            task_settings=None if task is None else task.task_settings(args),
        )


def _stage_layers(args: argparse.Namespace, placement: Placement) -> Optional[StageLayers]:
    """:attr:`RunConfig.stage_layers` of the flags (None where they give no split)."""
    num_layers = getattr(args, "num_layers", None)
    flags = LayerSplitFlags.from_args(args)
    if num_layers is None or split_problems(flags, placement, num_layers):
        return None
    return split_layers(flags, placement, num_layers)


#: ModelShape's fields a namespace may leave out or None (ModelShape's defaults then hold)
_OPTIONAL_SHAPE_FLAGS = ("ffn_hidden_size", "num_query_groups", "normalization", "position_embedding_type",
                         "max_position_embeddings", "make_vocab_size_divisible_by", "hidden_dropout",
                         "attention_dropout", "kv_channels", "norm_epsilon", "init_method_std", "rotary_base")  # fmt: skip


def model_shape_of(args: argparse.Namespace, vocab_size: Optional[int], moe: Optional[MoESettings]) -> Optional[ModelShape]:
    """:attr:`RunConfig.model` of checked flags (either route's names; None without
    ``--num-layers``): ModelShape's rules are the flag check's, so this does not raise on a
    namespace that passed it."""
    if getattr(args, "num_layers", None) is None:
        return None
    backend = getattr(args, "attention_backend", "auto")
    optional = {name: getattr(args, name) for name in _OPTIONAL_SHAPE_FLAGS if getattr(args, name, None) is not None}
    if "norm_epsilon" not in optional and getattr(args, "layernorm_epsilon", None) is not None:
        optional["norm_epsilon"] = args.layernorm_epsilon  # Megatron-LM's older name
    return ModelShape(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        seq_length=args.seq_length,
        vocab_size=vocab_size,
        micro_batch_size=args.micro_batch_size,
        swiglu=bool(getattr(args, "swiglu", False)),
        add_bias_linear=bool(getattr(args, "add_bias_linear", True)),
        untie_embeddings_and_output_weights=bool(getattr(args, "untie_embeddings_and_output_weights", False)),
        attention_backend=getattr(backend, "name", backend),  # Megatron-LM's route: its AttnBackend member
        **optional,
        moe=None if moe is None else _moe_shape(moe),
    )


def _moe_shape(moe: MoESettings) -> MoEShape:
    """The simulator's view of a checked mixture-of-experts choice."""
    return MoEShape(
        num_experts=moe.num_experts,
        moe_router_topk=moe.router_topk,
        moe_ffn_hidden_size=moe.ffn_hidden_size,
        moe_layer_freq=moe.layer_freq,
        moe_shared_expert_intermediate_size=moe.shared_expert_intermediate_size,
        moe_expert_capacity_factor=moe.capacity_factor,
        expert_model_parallel_size=moe.expert_parallel,
    )
