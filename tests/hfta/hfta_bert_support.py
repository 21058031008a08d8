"""Rank-side code of the fused-BERT tests (``tests/hfta/test_hfta_bert.py``): train a fused array of
BERTs and each model's unfused BERT with the training loop of ``pretrain_bert.py``
(:class:`~megatron_bitpipe.training.loop.Trainer` with
:class:`~megatron_bitpipe.training.bert.BertTask`) and record, per step, the logged losses and
each model's gradients (as clipped) and weights.

A fused parameter ``[B, ...]`` is recorded as model ``k``'s slices under the unfused names, so
fused and unfused records compare key by key; pipeline ranks record their chunks under global
names (the test merges the ranks).
"""

from __future__ import annotations

from typing import List, Optional

from .hfta_support import held_masks, named_tensors

MODEL = [
    "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "100", "--make-vocab-size-divisible-by", "64",
    "--lr-warmup-iters", "1", "--min-lr", "1e-5", "--clip-grad", "0.5", "--weight-decay", "0.1", "--adam-eps", "1e-4",
    "--log-interval", "1", "--eval-iters", "1", "--train-iters", "3", "--seed", "1234",
]  # fmt: skip
LRS = (3e-3, 5e-4)
SEEDS = (1234, 7)
#: the model extracted from the fused checkpoint
EXTRACTED = 1


def hfta_flags() -> List[str]:
    return ["--hfta-models", str(len(LRS)), "--hfta-lr", ",".join(map(str, LRS)), "--hfta-seeds", ",".join(map(str, SEEDS)), "--lr", str(max(LRS))]


def trainer(argv: List[str]):
    """The training loop of ``pretrain_bert.py`` with ``argv`` (mock data), on this rank."""
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.run_config import RunConfig, TokenizerSettings
    from megatron_bitpipe.training import distributed
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.bert import BertTask
    from megatron_bitpipe.training.data import build_tokenizer
    from megatron_bitpipe.training.loop import Trainer

    task = BertTask()
    args = parse_args(task, argv)
    tokenizer = build_tokenizer(TokenizerSettings.from_args(args))
    run = RunConfig.from_args(args, tokenizer.vocab_size, task)
    return Trainer(task, args, run, tokenizer, distributed.initialize(run, enable_cpu_megatron))


def step_record(trainer, num_models: Optional[int]) -> dict:
    """One training iteration: its logged losses and fields, and per model (``num_models``
    None: the unfused model) the gradients (with a sharded optimizer: NaN outside this rank's
    shares, :func:`~tests.hfta.hfta_support.held_masks`) and weights."""
    held = held_masks(trainer)
    record = trainer.train_step()
    grads = named_tensors(trainer, lambda p: p.main_grad)
    weights = named_tensors(trainer, lambda p: p)
    split = (lambda t: [t]) if num_models is None else (lambda t: list(t.unbind(0)))
    mine = lambda name, k, t: t.masked_fill(~held[name][k], float("nan")) if name in held else t  # noqa: E731
    models = [
        {"grads": {n: mine(n, k, split(g)[k]) for n, g in grads.items()}, "weights": {n: split(w)[k] for n, w in weights.items()}}
        for k in range(num_models or 1)
    ]
    return dict(losses=record.losses, extra=record.extra, grad_norm=record.grad_norm, models=models)


def train_records(argv: List[str], steps: int, num_models: Optional[int], init_seed: Optional[int] = None, save_after=()) -> dict:
    """Rank body: ``steps`` iterations (:func:`step_record`) and the validation losses after
    them; ``init_seed``: the unfused model starts from that seed's weights (the data follows
    ``--seed``, as the fused array's does); a checkpoint (``--save``) after each iteration of
    ``save_after``."""
    from megatron_bitpipe.model.init import initialize_from_seed

    run = trainer(argv)
    if init_seed is not None:  # fp32 Adam holds the parameters themselves: overwrite them in place
        initialize_from_seed(run.model.chunks, run.model.specs, init_seed, run.groups.tp)
    records = []
    for step in range(1, steps + 1):
        records.append(step_record(run, num_models))
        if step in save_after:
            run.save()
    return dict(steps=records, validation=run.evaluate())


def reference_records(root: str, steps: int) -> dict:
    """Rank body (one rank): the fused array of :data:`LRS` / :data:`SEEDS` in one process
    (``fused``, saving checkpoints after iterations 2 and ``steps``), each model's unfused run
    with ``--lr`` its rate from its seed's weights (``unfused[k]``), iteration 3 of the array
    resumed from its iteration-2 checkpoint (``resumed``), and the validation losses of model
    :data:`EXTRACTED` extracted from the last checkpoint (``scripts/hfta_extract.py``'s
    function) and loaded by the training loop as an ordinary BERT with ``--no-load-optim``
    (``extracted``)."""
    from megatron_bitpipe.hfta.extract import extract_model

    fused_argv = [*MODEL, *hfta_flags()]
    fused = train_records([*fused_argv, "--save", f"{root}/fused"], steps, len(LRS), save_after=(2, steps))
    unfused = [train_records([*MODEL, "--lr", str(lr)], steps, None, init_seed=seed) for lr, seed in zip(LRS, SEEDS)]
    resumed = step_record(trainer([*fused_argv, "--load", f"{root}/fused", "--ckpt-step", "2"]), len(LRS))
    extract_model(f"{root}/fused", EXTRACTED, f"{root}/extracted")
    model = trainer([*MODEL, "--lr", str(LRS[EXTRACTED]), "--load", f"{root}/extracted", "--no-load-optim"])
    return dict(fused=fused, unfused=unfused, resumed=resumed, extracted=dict(iteration=model.state.iteration, validation=model.evaluate()))
