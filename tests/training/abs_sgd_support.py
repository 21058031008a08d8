"""Rank-side code of the ABS-SGD tests: training runs that record their samples, and the
single-process fp64 replay of ABS-SGD's delayed update.

:func:`train_case` trains with the pretrain loop (:class:`~megatron_bitpipe.training.loop.Trainer`)
on the launcher's ranks with a GPT task whose training set records every sample index it
is asked for, and returns the rank's record: its sample indices in reading order, its
parameters under their full-model names, its data-parallel/pipeline coordinates and (rank 0)
the ``--log-json`` records.

:func:`replay` is an independent statement of the method: one process, float64, the same
seed-initialised model; iteration ``k`` computes the gradient sum ``G^k`` of every replica's
micro-batches (the recorded sample indices, split by the logged counts) at the current
weights, then applies ``G^{k-delay}`` normalised by its micro-batch count with the
optimizer's rules written out: global-norm clipping, AdamW (no weight decay on biases and
1-D parameters) and Megatron's learning-rate schedule advanced by the applied samples. Its
pieces (:func:`reference_gpt`, :func:`microbatch_loss`, :func:`clip_gradients`,
:func:`decays`) also serve the decentralized modes' replay (``tests/training/decentralized_support.py``).
"""

from __future__ import annotations

import json
import time
from typing import Callable, Dict, List, Optional, Sequence

import torch

from megatron_bitpipe.training.gpt import GPTTask


class RecordingDataset:
    """A dataset that notes every index it is asked for, in order."""

    def __init__(self, dataset):
        self.dataset = dataset
        self.indices: List[int] = []

    def __getitem__(self, index: int):
        self.indices.append(int(index))
        return self.dataset[index]


class RecordingGPTTask(GPTTask):
    """GPT whose training set records the indices read."""

    def build_datasets(self, run, tokenizer):
        train, valid, test = super().build_datasets(run, tokenizer)
        self.recorded = RecordingDataset(train)
        return self.recorded, valid, test


def _full_parameters(model) -> Dict[str, torch.Tensor]:
    from megatron.core.utils import unwrap_model

    from megatron_bitpipe.model_partition import to_global_name

    params = {}
    for chunk, spec in zip(model.chunks, model.specs):
        for name, param in unwrap_model(chunk).named_parameters():
            params[to_global_name(name, spec)] = param.detach().clone()
    return params


def train_case(argv: Sequence[str], log_json: str, probe: Optional[Callable] = None) -> dict:
    """Rank body: train with ``argv`` (plus ``--log-json log_json``); this rank's record, or
    ``{"error": message}`` if the loop refused a checkpoint. ``probe(trainer)`` (a
    module-level function) adds its dict to the record after training."""
    import torch.distributed as dist

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.training import distributed
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.data import build_tokenizer
    from megatron_bitpipe.checkpoint_rules import CheckpointError
    from megatron_bitpipe.training.exit_conditions import ExitConditions
    from megatron_bitpipe.training.loop import Trainer
    from megatron_bitpipe.run_config import RunConfig, TokenizerSettings

    task = RecordingGPTTask()
    args = parse_args(task, [*argv, "--log-json", log_json])
    tokenizer = build_tokenizer(TokenizerSettings.from_args(args))
    run = RunConfig.from_args(args, tokenizer.vocab_size, task)
    env = distributed.initialize(run, enable_cpu_megatron)
    try:
        trainer = Trainer(task, args, run, tokenizer, env)
    except CheckpointError as error:
        dist.barrier()
        return {"error": str(error)}
    with ExitConditions(run.exits, time.time()) as exits:
        trainer.train(exits)
    dist.barrier()
    records = None
    if env.rank == 0:
        with open(log_json, encoding="utf-8") as f:
            records = {r["iteration"]: r for r in map(json.loads, f.read().splitlines()) if r["event"] == "iteration"}
    groups = trainer.model.groups
    return {
        "indices": task.recorded.indices,
        "params": _full_parameters(trainer.model),
        "dp_rank": groups.dp_rank,
        "pp_rank": groups.pp_rank,
        "tp_rank": groups.tp_rank,
        "records": records,
        **(probe(trainer) if probe is not None else {}),
    }


def replica_batches(per_rank: List[dict], records: Dict[int, dict], micro_batch_size: int) -> List[List[List[List[int]]]]:
    """``batches[j][r]``: the micro-batches (lists of sample indices) replica ``r`` computed
    in applied batch ``j`` (iterations whose gradients were applied, in order), from the
    indices its pipeline-rank-0, TP-rank-0 rank read and the logged counts; asserts the
    rank read them as whole micro-batches."""
    streams = {}
    for rank in per_rank:
        if rank["pp_rank"] == 0 and rank["tp_rank"] == 0:
            streams[rank["dp_rank"]] = rank["indices"]
    applied = [records[k] for k in sorted(records) if records[k]["abs_samples_per_replica"] is not None]
    batches, offsets = [], {r: 0 for r in streams}
    for record in applied:
        batch = []
        for r, samples in enumerate(record["abs_samples_per_replica"]):
            taken = streams[r][offsets[r] : offsets[r] + samples]
            offsets[r] += samples
            batch.append([taken[i : i + micro_batch_size] for i in range(0, samples, micro_batch_size)])
        batches.append(batch)
    return batches


def reference_gpt(argv: Sequence[str]):
    """Rank body helper (one rank): ``(args, net, datasets)`` — the seed-initialised
    single-process GPT of ``argv`` (its parallelism flags ignored) in float64, and its
    training, validation and test sets."""
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.model.build import init_megatron_state
    from megatron_bitpipe.execution.groups import ParallelGrid, PipelineGroups
    from megatron_bitpipe.model.init import initialize_from_seed
    from megatron_bitpipe.model_partition import chunk_specs
    from megatron_bitpipe.model.chunks import build_gpt_chunks
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.run_config import RunConfig, TokenizerSettings
    from megatron_bitpipe.training.config import lr_scheduler, transformer_config, use_global_tp_group
    from megatron_bitpipe.training.data import build_tokenizer, collate

    enable_cpu_megatron()
    task = GPTTask()
    args = parse_args(task, list(argv), world_size=1)
    tokenizer = build_tokenizer(TokenizerSettings.from_args(args))
    run = RunConfig.from_args(args, tokenizer.vocab_size, task)
    placement = run.placement
    groups = PipelineGroups.build(ParallelGrid(), placement)
    use_global_tp_group(groups.tp)
    init_megatron_state(groups.rank_pgs, args.seed)
    config = transformer_config(run)
    (net,) = build_gpt_chunks(
        config, groups, vocab_size=run.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights, rotary_base=args.rotary_base,
    )  # fmt: skip
    specs = chunk_specs(placement, config.num_layers, 0, not args.untie_embeddings_and_output_weights)
    initialize_from_seed([net], specs, args.seed, groups.tp)
    net.double()
    return args, net, task.build_datasets(run, tokenizer)


def decays(name: str, param: torch.Tensor) -> bool:
    """Whether megatron's default parameter groups apply weight decay (not to biases and
    1-D parameters)."""
    return not (param.dim() == 1 or name.endswith(".bias"))


def microbatch_loss(net, dataset, samples: Sequence[int]) -> tuple:
    """``(mean loss, loss sum, token count)`` of one micro-batch (the mean is what a
    micro-batch contributes to the gradient)."""
    import torch.nn.functional as F

    from megatron_bitpipe.training.data import collate

    mb = collate([dataset[i] for i in samples])
    logits = net(mb["tokens"], mb["position_ids"], None)  # [b, s, vocab]
    losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), mb["labels"].reshape(-1), reduction="none")
    mask = mb["loss_mask"].reshape(-1).double()
    total = (losses * mask).sum()
    return total / mask.sum(), total, mask.sum()


def clip_gradients(params: Sequence[torch.Tensor], clip: float) -> None:
    """megatron's global-norm clipping of the parameters' ``.grad``."""
    norm = torch.sqrt(sum((p.grad**2).sum() for p in params))
    coefficient = clip / (norm + 1.0e-6)
    if clip > 0 and coefficient < 1.0:
        for p in params:
            p.grad.mul_(coefficient)


def replay(argv: Sequence[str], batches: List[List[List[List[int]]]], delay: int, iterations: int) -> Dict[str, torch.Tensor]:
    """Rank body (one rank): the weights after ``iterations`` ABS-SGD iterations of the model
    of ``argv`` (its data-parallel flags ignored) in float64; ``batches[j]`` is applied batch
    ``j``'s micro-batches by replica. With ``delay`` 1, iteration ``k`` (1-based) computes
    batch ``k - 1`` and applies batch ``k - 2``; with 0 it computes and applies batch ``k - 1``."""
    from megatron_bitpipe.run_config import RunConfig
    from megatron_bitpipe.training.config import lr_scheduler

    args, net, (train, _, _) = reference_gpt(argv)
    named = dict(net.named_parameters())
    decay = [p for n, p in named.items() if decays(n, p)]
    no_decay = [p for n, p in named.items() if not decays(n, p)]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "wd_mult": 1.0}, {"params": no_decay, "wd_mult": 0.0}],
        lr=args.lr, weight_decay=args.weight_decay, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
    )  # fmt: skip
    scheduler = lr_scheduler(RunConfig.from_args(args), optimizer)

    def gradient_sum(batch) -> List[torch.Tensor]:
        """Sum over the micro-batches of every replica of each micro-batch's mean-loss gradient."""
        for p in named.values():
            p.grad = None
        count = 0
        for replica in batch:
            for samples in replica:
                microbatch_loss(net, train, samples)[0].backward()
                count += 1
        return [p.grad.clone() for p in named.values()], count

    def apply(grads: List[torch.Tensor], count: int) -> None:
        for p, g in zip(named.values(), grads):
            p.grad = g / count
        clip_gradients(list(named.values()), args.clip_grad)
        optimizer.step()
        scheduler.step(increment=count * args.micro_batch_size)

    computed = []
    for k in range(iterations):
        if k < len(batches):
            computed.append(gradient_sum(batches[k]))
        applied = k - delay
        if applied >= 0:
            apply(*computed[applied])
    return {name: p.detach().clone() for name, p in named.items()}
