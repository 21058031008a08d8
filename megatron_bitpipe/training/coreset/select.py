"""``scripts/select_coreset.py``: choose a CRAIG coreset of a run's training samples.

    python scripts/select_coreset.py [the run's data and model flags] --fraction 0.25 \\
        --coreset-warmup-iters 20 --output coreset.npz

The flags are the pretrain script's (the same ``--data-path``, ``--split``, ``--seq-length``,
``--seed``, tokenizer, ``--train-iters`` and ``--global-batch-size`` as the training run that
will read the file) plus the selection's own (:class:`SelectionSettings`). Steps:

1. flags checked (exit 2, nothing done yet), then the training samples built as training
   builds them (megatron-core's builder; a dataset without training samples: exit 2). The
   candidates are the n = ``--train-iters`` x ``--global-batch-size`` samples the run would
   train on, in its order.
2. ``craig``: a model — ``--load DIR`` (any layout's checkpoint; ``--finetune`` loads its
   weights only, without the checks of its schedule against these flags) and/or
   ``--coreset-warmup-iters`` iterations of training on the first training samples with the
   flags' optimizer and schedule — gives each candidate its proxy (:mod:`.proxies`:
   the output layer's gradient, dimension = padded vocabulary); per shard of
   ``--coreset-shard-size`` candidates, lazy-greedy facility location chooses
   max(1, round(fraction x shard)) of them and their γ (:mod:`.facility`).
   ``random``: the same number k, uniformly without replacement (``--seed``), γ = n / k.
   ``--fraction 1`` keeps every sample with γ = 1 (no model).
3. One ``.npz`` (:mod:`.identity`); the counts, the time of each step and the peak memory
   (the process's maximum resident set) on stdout, a progress bar on stderr.

Runs as one process (``--pipeline-model-parallel-size`` and ``--tensor-model-parallel-size``
1: the proxies need the whole model's logits; checkpoints of other layouts load into it).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, List, Optional, Sequence

if TYPE_CHECKING:
    import torch

import numpy as np

from ...data_parallel_modes import SYNC, selected_mode
from ...megatron_args import BitPipeConfigError
from ..arguments import parse_args
from ..task import TaskArguments
from .facility import Selection, select_shard, shard_bounds, shard_size_of
from .identity import CoresetFile, DatasetIdentity, write_coreset

__all__ = ["METHODS", "SelectionArguments", "SelectionSettings", "main", "proxy_trainer", "select"]

#: --coreset-method values
METHODS = ("craig", "random")
#: default --coreset-shard-size: 8 x 2048² bytes = 32 MiB of distances per shard
DEFAULT_SHARD_SIZE = 2048
#: proxy description written into the file's info
PROXY = "output-layer gradient summed over positions: sum_t m_t (softmax(z_t) - onehot(y_t)) / sum_t m_t, dim = padded vocab"


@dataclass(frozen=True)
class SelectionSettings:
    """The selection's flags, made once from the parsed Namespace."""

    fraction: float
    output: str
    method: str
    warmup_iters: int
    shard_size: int
    load: Optional[str]

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "SelectionSettings":
        return cls(args.fraction, args.output, args.coreset_method, args.coreset_warmup_iters, args.coreset_shard_size, args.load)

    @property
    def needs_model(self) -> bool:
        return self.method == "craig" and self.fraction < 1.0


class SelectionArguments(TaskArguments):
    """The selection's flags and rules, added to the pretrain script's."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None:
        group = parser.add_argument_group(title="coreset selection")
        group.add_argument("--fraction", type=float, required=True, help="share of the training samples to keep, in (0, 1]")
        group.add_argument("--output", required=True, metavar="FILE.npz", help="the coreset file to write")
        group.add_argument("--coreset-method", choices=METHODS, default="craig", help="craig (default) or a uniform random subset")
        group.add_argument(
            "--coreset-warmup-iters",
            type=int,
            default=0,
            help="iterations to train the proxy model first (after --load, if given); default 0",
        )
        group.add_argument(
            "--coreset-shard-size",
            type=int,
            default=DEFAULT_SHARD_SIZE,
            help=f"candidates per facility-location shard (memory 8 x size² bytes); default {DEFAULT_SHARD_SIZE}",
        )

    def validate(self, args: argparse.Namespace) -> List[str]:
        problems = []
        if not 0.0 < args.fraction <= 1.0:
            problems.append(f"--fraction must be in (0, 1] (got {args.fraction})")
        if args.coreset_warmup_iters < 0:
            problems.append(f"--coreset-warmup-iters must be >= 0 (got {args.coreset_warmup_iters})")
        elif args.coreset_warmup_iters > args.train_iters:
            problems.append(f"--coreset-warmup-iters {args.coreset_warmup_iters} must not exceed --train-iters {args.train_iters}")
        if args.coreset_shard_size < 1:
            problems.append(f"--coreset-shard-size must be positive (got {args.coreset_shard_size})")
        needs_model = args.coreset_method == "craig" and 0.0 < args.fraction < 1.0
        if needs_model and args.load is None and args.coreset_warmup_iters == 0:
            problems.append("--coreset-method craig needs a model for its proxies: --load DIR or --coreset-warmup-iters N > 0")
        if args.world_size != 1:
            problems.append(f"select_coreset.py runs as one process (the job has {args.world_size})")
        for flag, value in (("--pipeline-model-parallel-size", args.pipeline_model_parallel_size), ("--tensor-model-parallel-size", args.tensor_model_parallel_size)):
            if value != 1:
                problems.append(f"{flag} must be 1 for select_coreset.py (got {value}; a checkpoint of any layout loads)")
        if selected_mode(args) is not SYNC:
            problems.append(f"--data-parallel-mode must be {SYNC.name} for a coreset (got {args.data_parallel_mode})")
        directory = os.path.dirname(os.path.abspath(args.output))
        if not os.path.isdir(directory):
            problems.append(f"--output {args.output}: no directory {directory}")
        return problems


class Progress:
    """A progress bar on stderr: ``label done/total [percent] elapsed``, redrawn at most every
    0.2 s and at the end."""

    def __init__(self, label: str, total: int, stream=None):
        self.label, self.total, self.stream = label, total, stream or sys.stderr
        self.done, self.started, self.drawn = 0, time.perf_counter(), 0.0

    def __call__(self, count: int) -> None:
        self.done += count
        now = time.perf_counter()
        if now - self.drawn >= 0.2 or self.done >= self.total:
            self.drawn = now
            width = 30
            filled = width * self.done // max(self.total, 1)
            bar = "#" * filled + "." * (width - filled)
            end = "\n" if self.done >= self.total else ""
            self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {now - self.started:.1f}s{end}")
            self.stream.flush()


def _craig(proxies_of: Callable[[int, int], np.ndarray], n: int, settings: SelectionSettings, timings: dict) -> Selection:
    """CRAIG over the shards; ``proxies_of(start, stop)`` gives a shard's proxies. Adds the
    seconds spent on proxies and on facility location to ``timings``."""
    indices, gammas = [], []
    progress = Progress("coreset shards (proxies, facility location)", n)
    timings["proxies_s"] = timings["facility_location_s"] = 0.0
    for start, stop in shard_bounds(n, settings.shard_size):
        started = time.perf_counter()
        proxies = proxies_of(start, stop)
        chosen = time.perf_counter()
        shard = select_shard(proxies, settings.fraction)
        timings["proxies_s"] += chosen - started
        timings["facility_location_s"] += time.perf_counter() - chosen
        indices.append(shard.indices + start)
        gammas.append(shard.gamma)
        progress(stop - start)
    return Selection(np.concatenate(indices), np.concatenate(gammas))


def selected_count(n: int, settings: SelectionSettings) -> int:
    """k: the samples the shards keep together."""
    return sum(shard_size_of(stop - start, settings.fraction) for start, stop in shard_bounds(n, settings.shard_size))


def _random(n: int, seed: int, settings: SelectionSettings) -> Selection:
    k = selected_count(n, settings)
    chosen = np.sort(np.random.default_rng(seed).choice(n, size=k, replace=False)).astype(np.int64)
    return Selection(chosen, np.full(k, n / k))


def select(args: argparse.Namespace, cpu_fallback: Optional[Callable[[], Optional[torch.device]]] = None, log=print) -> CoresetFile:
    """Choose and write the coreset of the checked flags ``args`` (see the module docstring);
    returns it. A process group this starts (for the proxy model) is ended; a caller's stays."""
    import torch.distributed as dist

    from ...run_config import RunConfig, TokenizerSettings
    from ..data import build_tokenizer
    from ..gpt import GPTTask

    owns_group = not dist.is_initialized()  # a caller's group (a test launcher's) stays
    settings = SelectionSettings.from_args(args)
    identity = DatasetIdentity.from_args(args)
    n = identity.train_samples
    started = time.perf_counter()
    tokenizer = build_tokenizer(TokenizerSettings.from_args(args))
    # the whole training set (the one chosen from): a dataset without training samples fails here, before any work
    GPTTask().build_datasets(RunConfig.from_args(args, tokenizer.vocab_size), tokenizer)
    timings = {"datasets_s": time.perf_counter() - started}
    if not settings.needs_model:
        if settings.fraction == 1.0:
            selection = Selection(np.arange(n, dtype=np.int64), np.ones(n))
        else:
            selection = _random(n, args.seed, settings)
        timings["selection_s"] = time.perf_counter() - started - timings["datasets_s"]
    else:
        try:
            selection = _select_with_model(args, settings, n, cpu_fallback, timings, log)
        finally:
            if owns_group and dist.is_initialized():
                dist.destroy_process_group()
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    info = {
        "fraction": settings.fraction,
        "method": settings.method,
        "selected": int(len(selection.indices)),
        "proxy": PROXY if settings.needs_model else None,
        "shard_size": settings.shard_size,
        "load": settings.load,
        "warmup_iters": settings.warmup_iters if settings.needs_model else 0,
        "peak_memory_mib": round(peak_mib, 1),
        **{k: round(v, 3) for k, v in timings.items()},
    }
    coreset = CoresetFile(selection.indices, selection.gamma, identity, info)
    write_coreset(settings.output, coreset)
    log(f"coreset: {len(selection.indices)} of {n} training samples ({settings.method}, fraction {settings.fraction}) -> {settings.output}")
    log("coreset timings (s): " + ", ".join(f"{k[:-2]} {v:.2f}" for k, v in timings.items()) + f" | peak memory (MiB): {peak_mib:.1f}")
    return coreset


def proxy_trainer(args: argparse.Namespace, cpu_fallback: Optional[Callable[[], Optional[torch.device]]] = None):
    """The pretrain loop's :class:`~..loop.Trainer` (model, optimizer, schedule, datasets,
    ``--load``) of the checked flags ``args`` in this process (collective: it starts or joins
    the process group)."""
    from .. import distributed
    from ..data import build_tokenizer
    from ..gpt import GPTTask
    from ..loop import Trainer
    from ...run_config import RunConfig, TokenizerSettings

    tokenizer = build_tokenizer(TokenizerSettings.from_args(args))
    task = GPTTask()
    run = RunConfig.from_args(args, tokenizer.vocab_size, task)
    env = distributed.initialize(run, cpu_fallback)
    return Trainer(task, args, run, tokenizer, env)


def _select_with_model(args, settings: SelectionSettings, n: int, cpu_fallback, timings: dict, log) -> Selection:
    """CRAIG with the proxy model of ``--load`` / the warm-up (one process: it starts the
    process group, the caller ends it)."""
    from ...checkpoint_checks import find_checkpoint
    from ..data import collate
    from .proxies import proxies_for

    if settings.load is not None and find_checkpoint(settings.load, args.ckpt_step) is None:
        raise BitPipeConfigError(f"--load {settings.load}: no checkpoint there (the proxies would come from an untrained model)")
    started = time.perf_counter()
    trainer = proxy_trainer(args, cpu_fallback)
    for _ in range(settings.warmup_iters):
        record = trainer.train_step()
        if record.iteration % max(1, settings.warmup_iters // 5) == 0 or record.iteration == settings.warmup_iters:
            log(f"coreset warm-up iteration {record.iteration}: lm loss {record.losses['lm loss']:.4f}")
    timings["model_s"] = time.perf_counter() - started
    chunk = trainer.model.chunks[0]
    samples = trainer.train_data.__getitem__

    def proxies_of(start: int, stop: int) -> np.ndarray:
        return proxies_for(chunk, samples, range(start, stop), trainer.run_config.batches.micro_batch_size, collate, trainer.env.device)

    return _craig(proxies_of, n, settings, timings)


def main(argv: Optional[Sequence[str]] = None, cpu_fallback: Optional[Callable[[], Optional[torch.device]]] = None, prog: str = "select_coreset.py") -> int:
    """The script: 0 done, 2 bad flags or data (one message on stderr, before any work), 1 a
    ``--load`` checkpoint that does not fit (the pretrain scripts' statuses)."""
    from ..script import exit_status

    return exit_status(prog, lambda: select(parse_args(SelectionArguments(), argv, prog=prog), cpu_fallback))
