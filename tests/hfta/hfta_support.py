"""Rank-side code of the HFTA tests: train a fused array and each model's unfused run with the
training loop (:class:`~megatron_bitpipe.training.loop.Trainer`) and record, per step, each
model's losses, gradients (after clipping, as the optimizer used them) and weights.

A fused parameter ``[B, ...]`` is recorded as model ``k``'s slices under the unfused names, so
the two records compare key by key. Pipeline layouts record this rank's chunks under global
layer names (tensor-parallel blocks gathered into full tensors); the test merges the ranks.
"""

from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, List, Optional, Tuple

import torch

MODEL = [
    "--num-layers", "8", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
    "--micro-batch-size", "2", "--global-batch-size", "8", "--vocab-size", "100", "--make-vocab-size-divisible-by", "64",
    "--lr-warmup-iters", "1", "--min-lr", "1e-5", "--clip-grad", "0.5", "--weight-decay", "0.1", "--adam-eps", "1e-4",
    "--log-interval", "1", "--eval-interval", "2", "--eval-iters", "1", "--train-iters", "3", "--seed", "1234",
]  # fmt: skip
LRS = (3e-3, 1e-3, 5e-4)
SEEDS = (1234, 7, 99)


def hfta_flags(lrs=LRS, seeds=SEEDS) -> List[str]:
    return ["--hfta-models", str(len(lrs)), "--hfta-lr", ",".join(map(str, lrs)), "--hfta-seeds", ",".join(map(str, seeds)), "--lr", str(max(lrs))]


def named_tensors(trainer, of) -> Dict[str, torch.Tensor]:
    """``of(param)`` of this rank's chunks under global names, tensor-parallel blocks
    all-gathered into the full ``[B, ...]`` tensors (collective over the tensor-parallel group)."""
    from megatron_bitpipe.testing.weights import collect_full, merge_full

    return merge_full(collect_full(c, of, chunk=s, tp_group=trainer.groups.tp) for c, s in zip(trainer.model.chunks, trainer.model.specs))


def _share_of(trainer) -> dict:
    """``id(fused parameter) -> share`` of a sharded fused-array optimizer (empty otherwise):
    the elements ``[start, stop)`` of each model's flattened slice whose state this rank holds."""
    optimizer = trainer.optimizer
    return {id(fused.param): fused.share for fused in optimizer.fused} if getattr(optimizer, "sharded", False) else {}


def _shares(trainer) -> Dict[str, Tuple[int, int]]:
    """``name -> (start, stop)``: :func:`_share_of` by this rank's parameter names (of its
    tensor-parallel block)."""
    from megatron.core.utils import unwrap_model

    from megatron_bitpipe.model_partition import to_global_name

    share_of = _share_of(trainer)
    return {
        to_global_name(name, spec): (share_of[id(param)].start, share_of[id(param)].stop)
        for chunk, spec in zip(trainer.model.chunks, trainer.model.specs)
        for name, param in unwrap_model(chunk).named_parameters()
        if id(param) in share_of
    }


def held_masks(trainer) -> Dict[str, torch.Tensor]:
    """``name -> bool [B, ...]`` (the whole tensor, tensor-parallel blocks gathered): the
    elements of each model's slice whose optimizer state this rank holds, :func:`_share_of`
    (empty without a sharded optimizer). Collective over the tensor-parallel group."""
    share_of = _share_of(trainer)
    if not share_of:
        return {}

    def held(param):
        mask = torch.zeros(param.shape)
        for k in range(param.shape[0]):
            mask[k].view(-1)[share_of[id(param)].start : share_of[id(param)].stop] = 1
        return mask

    return {name: mask.bool() for name, mask in named_tensors(trainer, held).items()}


def state_elements(optimizer) -> int:
    """Elements of the Adam moments and fp32 main weights this rank's optimizer holds."""
    count = 0
    for part in optimizer.chained_optimizers:
        for state in part.optimizer.state.values():
            count += sum(state[key].numel() for key in ("exp_avg", "exp_avg_sq") if key in state)
        count += sum(main.numel() for group in getattr(part, "fp32_from_float16_groups", []) for main in group)
    return count


def train_records(argv: List[str], steps: int, num_models: Optional[int], init_seed: Optional[int] = None, save_after=()) -> dict:
    """Rank body: ``steps`` iterations of the training loop with ``argv`` (after the checkpoint
    ``--load`` names, if any; saving after the iterations ``save_after`` under ``--save``); per step
    the logged losses and extra fields, and (fused: per model, ``models[k]``) gradients and
    weights. With a sharded optimizer only the gradient elements of this rank's shares are
    recorded, the others are NaN (clipping touches only the shares; ``shares``: their
    ``(start, stop)`` in each model's flattened tensor-parallel block); the weights whole.
    ``state_elements``: the optimizer state this rank holds at the end.
    ``init_seed``: an unfused model starts from that seed's weights (the data still follows
    ``--seed``, as the fused array's does)."""
    trainer = _trainer(argv)
    if init_seed is not None:  # overwrite the weights in place, then the fp32 main weights of bf16 from them
        from megatron_bitpipe.model.init import initialize_from_seed

        initialize_from_seed(trainer.model.chunks, trainer.model.specs, init_seed, trainer.groups.tp)
        trainer.optimizer.reload_model_params()
    shares, held = _shares(trainer), held_masks(trainer)
    records = []
    for _ in range(steps):
        record = trainer.train_step()
        if record.iteration in save_after:
            trainer.save()
        grads = named_tensors(trainer, lambda p: p.main_grad)
        weights = named_tensors(trainer, lambda p: p)
        split = (lambda t: [t]) if num_models is None else (lambda t: list(t.unbind(0)))
        mine = lambda name, k, t: t.masked_fill(~held[name][k], float("nan")) if name in held else t  # noqa: E731
        models = [
            {"grads": {n: mine(n, k, split(g)[k]) for n, g in grads.items()}, "weights": {n: split(w)[k] for n, w in weights.items()}}
            for k in range(num_models or 1)
        ]
        records.append(dict(losses=record.losses, extra=record.extra, grad_norm=record.grad_norm, lr=record.lr, models=models))
    validation = trainer.evaluate()
    return dict(steps=records, validation=validation, shares=shares, state_elements=state_elements(trainer.optimizer))


def reference_records(steps: int, flags=()) -> dict:
    """Rank body (one rank): the fused array of :data:`LRS`/:data:`SEEDS` in one process
    (``fused``) and each model's unfused run with ``--lr`` its rate, starting from its seed's
    weights (``unfused[k]``); ``flags`` added to all (``--bf16``)."""
    fused = train_records([*MODEL, *hfta_flags(), *flags], steps, len(LRS))
    unfused = [train_records([*MODEL, "--lr", str(lr), *flags], steps, None, init_seed=seed) for lr, seed in zip(LRS, SEEDS)]
    return dict(fused=fused, unfused=unfused)


def _trainer(argv: List[str]):
    """A :class:`~megatron_bitpipe.training.loop.Trainer` of ``argv`` (the GPT task). With
    ``--bf16`` the flags are checked as on a GPU (the rule "--bf16 needs a CUDA GPU" is the
    scripts'; megatron-core trains bf16 on the CPU), with gloo."""
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.training import distributed
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.data import build_tokenizer
    from megatron_bitpipe.training.gpt import GPTTask
    from megatron_bitpipe.run_config import RunConfig, TokenizerSettings
    from megatron_bitpipe.training.loop import Trainer

    task = GPTTask()
    bf16 = "--bf16" in argv
    args = parse_args(task, [*argv, "--distributed-backend", "gloo"] if bf16 else argv, cuda_available=bf16)
    tokenizer = build_tokenizer(TokenizerSettings.from_args(args))
    run = RunConfig.from_args(args, tokenizer.vocab_size, task)
    return Trainer(task, args, run, tokenizer, distributed.initialize(run, enable_cpu_megatron))


def checkpoint_records(root: str) -> dict:
    """Rank body (one rank): a fused array trains 3 iterations saving at 2 and 3; a second run
    resumes from iteration 2; model 1 of the iteration-3 checkpoint is extracted
    (``scripts/hfta_extract.py``'s function) and evaluated as an unfused model loaded by the
    training loop, next to the fused array loaded from the same checkpoint."""
    import json

    from megatron_bitpipe.hfta.extract import extract_model
    from megatron_bitpipe.training.exit_conditions import ExitConditions

    fused = [*MODEL, *hfta_flags()]
    runs = {"full": [*fused, "--save", f"{root}/fused", "--save-interval", "2"], "resumed": [*fused, "--load", f"{root}/fused", "--ckpt-step", "2"]}
    logs = {}
    for name, argv in runs.items():
        trainer = _trainer([*argv, "--log-json", f"{root}/{name}.jsonl"])
        with ExitConditions(trainer.run_config.exits, time.time()) as exits:
            trainer.train(exits)
        with open(f"{root}/{name}.jsonl", encoding="utf-8") as lines:
            logs[name] = {r["iteration"]: r for r in map(json.loads, lines) if r["event"] == "iteration"}
    extract_model(f"{root}/fused", 1, f"{root}/model1")
    array = _trainer([*fused, "--load", f"{root}/fused"]).evaluate()
    model1 = _trainer([*MODEL, "--lr", str(LRS[1]), "--load", f"{root}/model1", "--no-load-optim"]).evaluate()
    return dict(logs=logs, array=array, model1=model1)


@contextlib.contextmanager
def shared_directory() -> Iterator[str]:
    """Rank body: a temporary directory that every rank of the launch names (rank 0 creates it
    and removes it at the end; collective over the launch's default group)."""
    import shutil
    import tempfile

    import torch.distributed as dist

    names = [tempfile.mkdtemp(prefix="hfta-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(names, src=0)
    try:
        yield names[0]
    finally:
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(names[0], ignore_errors=True)


def extracted_validation(load: str, k: int, save: str, argv: List[str]) -> dict:
    """Rank body: model ``k`` of the fused checkpoint under ``load`` extracted
    (``scripts/hfta_extract.py``'s function) to ``save`` and evaluated as an ordinary GPT loaded
    by the training loop with the model flags ``argv``: its validation losses."""
    from megatron_bitpipe.hfta.extract import extract_model

    extract_model(load, k, save)
    return _trainer([*argv, "--lr", str(LRS[k]), "--load", save, "--no-load-optim"]).evaluate()


def merged_ranks(ranks: List[dict], step: int, what: str) -> dict:
    """``model k -> name -> tensor`` over every rank's records of ``step``. A sharded optimizer's
    gradients are recorded where the rank holds them (NaN elsewhere): assembled into the whole
    tensor, every element of which must come from some rank, equal where two ranks hold it."""
    out: dict = {}
    for rank in ranks:
        for k, model in enumerate(rank["steps"][step]["models"]):
            for name, tensor in model[what].items():
                whole = out.setdefault(k, {}).setdefault(name, tensor.clone())
                held = ~tensor.isnan()
                assert torch.equal(whole[held & ~whole.isnan()], tensor[held & ~whole.isnan()]), f"{what} {name}: copies disagree"
                whole[held] = tensor[held]
    for model in out.values():
        for name, tensor in model.items():
            assert not tensor.isnan().any(), f"{what} {name}: elements no rank holds"
    return out
