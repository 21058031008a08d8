"""Rank-side code of the decentralized modes' tests: the single-process fp64 replay of n replicas.

:func:`replay` is an independent statement of each method (one process, float64, n copies of
the same seed-initialised model, written out from the papers' formulas, not from the
package's code): at iteration ``k`` replica ``r`` computes its gradient on the micro-batches
it read (the recorded sample indices), the mean of the micro-batches' mean-loss gradients,
clips it by its own norm (megatron's rule), adds weight decay (not to biases and 1-D
parameters) and applies the method with the learning rate of Megatron's schedule:

* ``sync``: the mean of the replicas' gradients, clipped, through ``torch.optim.SGD``
  (momentum, coupled weight decay);
* ``decentlam``: ``z = x - γ u``; ``m <- β m + (x - W z) / γ``; ``x <- x - γ m``
  (γ = 0: ``m <- β m + W u``, ``x`` stays);
* ``dmsgd``: ``m <- β m + u``; ``x <- W (x - γ m)``;
* ``lsgd``: every τ iterations the lowest mean loss over the period (token-weighted, the
  iteration's own included) elects the global and each group's local leader, whose weights
  (before the update) become the targets; ``m <- β m + u``;
  ``x <- x - γ m - γ (λ_l (x - x_l) + λ_g (x - x_g))``, with no pull toward oneself and none
  before the first election.

W is written out by hand for 2 and 4 replicas. It also returns what the evaluation of the
method's weights should give: the validation loss of the replicas' average (gossip) or of
the global leader (lsgd), and for lsgd the leaders of each election.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from .abs_sgd_support import clip_gradients, decays, microbatch_loss, reference_gpt

THIRD = 1.0 / 3.0
#: W[i][j] by hand: (topology, n) -> rows
MIXING = {
    ("ring", 4): [[THIRD, THIRD, 0, THIRD], [THIRD, THIRD, THIRD, 0], [0, THIRD, THIRD, THIRD], [THIRD, 0, THIRD, THIRD]],
    # symmetric exponential graph: i ± 1 with 1/6 each, i + 2 (= i - 2) with 1/3
    ("exponential", 4): [[THIRD, 1 / 6, THIRD, 1 / 6], [1 / 6, THIRD, 1 / 6, THIRD], [THIRD, 1 / 6, THIRD, 1 / 6], [1 / 6, THIRD, 1 / 6, THIRD]],
    ("complete", 4): [[0.25] * 4] * 4,
    ("ring", 2): [[0.5, 0.5], [0.5, 0.5]],
}


def replica_streams(per_rank: List[dict], iterations: int, microbatches: int, micro_batch_size: int) -> List[List[List[List[int]]]]:
    """``batches[k][r]``: the micro-batches replica ``r`` read in iteration ``k``, from the
    indices of its pipeline-rank-0, TP-rank-0 rank (asserting it read whole iterations)."""
    streams = {rank["dp_rank"]: rank["indices"] for rank in per_rank if rank["pp_rank"] == 0 and rank["tp_rank"] == 0}
    per_iteration = microbatches * micro_batch_size
    for r, indices in streams.items():
        assert len(indices) == iterations * per_iteration, (r, len(indices))
    return [
        [
            [streams[r][k * per_iteration + i : k * per_iteration + i + micro_batch_size] for i in range(0, per_iteration, micro_batch_size)]
            for r in range(len(streams))
        ]
        for k in range(iterations)
    ]


def _mix(weights: Sequence[float], vectors: List[List[torch.Tensor]]) -> List[torch.Tensor]:
    return [sum(w * v[i] for w, v in zip(weights, vectors) if w) for i in range(len(vectors[0]))]


def replay_case(case: dict) -> dict:
    """One case (see :func:`replay`); ``{"params": [per replica {name: tensor}], "validation":
    loss of the evaluated weights, "elections": [(iteration, global, locals)]}``. One model
    whose parameters take each replica's values in turn."""
    from megatron_bitpipe.run_config import RunConfig
    from megatron_bitpipe.training.config import lr_scheduler

    args, net, (train, valid, _) = reference_gpt(case["argv"])
    mode, batches = case["mode"], case["batches"]
    n = len(batches[0])
    names = [name for name, _ in net.named_parameters()]
    model = list(net.parameters())
    x = [[p.detach().clone() for p in model] for _ in range(n)]
    wd = [args.weight_decay if decays(name, p) else 0.0 for name, p in net.named_parameters()]
    beta = args.sgd_momentum
    momentum = [[torch.zeros_like(p) for p in model] for _ in range(n)]
    dummy = torch.zeros(1, requires_grad=True)
    schedule_holder = torch.optim.SGD([{"params": [dummy], "wd_mult": 1.0}], lr=args.lr)
    scheduler = lr_scheduler(RunConfig.from_args(args), schedule_holder)
    W = MIXING.get((case.get("topology"), n))
    sync = None
    if mode == "sync":
        sync = torch.optim.SGD(
            [{"params": [p for p, w in zip(model, wd) if w]}, {"params": [p for p, w in zip(model, wd) if not w], "weight_decay": 0.0}],
            lr=args.lr, momentum=beta, weight_decay=args.weight_decay,
        )  # fmt: skip
    period_sums = [[0.0, 0.0] for _ in range(n)]
    targets, leader, local_leaders, elections = None, None, None, []
    size = case.get("group_size", n)

    def load(values: List[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, v in zip(model, values):
                p.copy_(v)

    def gradient(r: int, microbatches) -> List[torch.Tensor]:
        """Replica ``r``'s clipped gradient at its weights; adds its losses to the period."""
        load(x[r])
        for p in model:
            p.grad = None
        for samples in microbatches:
            mean, total, count = microbatch_loss(net, train, samples)
            (mean / len(microbatches)).backward()
            period_sums[r][0] += float(total)
            period_sums[r][1] += float(count)
        if mode != "sync":
            clip_gradients(model, args.clip_grad)
        return [p.grad.detach().clone() for p in model]

    for k, batch in enumerate(batches, start=1):
        lr = schedule_holder.param_groups[0]["lr"]
        grads = [gradient(r, batch[r]) for r in range(n)]
        with torch.no_grad():
            if mode == "sync":
                load(x[0])
                for p, *g in zip(model, *grads):
                    p.grad = sum(g) / n
                clip_gradients(model, args.clip_grad)
                for group in sync.param_groups:
                    group["lr"] = lr
                sync.step()
                x = [[p.detach().clone() for p in model] for _ in range(n)]
            else:
                u = [[g + w * xi for g, w, xi in zip(grads[r], wd, x[r])] for r in range(n)]
                if mode == "decentlam":
                    if lr:
                        z = [[xi - lr * ui for xi, ui in zip(x[r], u[r])] for r in range(n)]
                        y = [_mix(W[i], z) for i in range(n)]
                        for i in range(n):
                            momentum[i] = [beta * m + (xi - yi) / lr for m, xi, yi in zip(momentum[i], x[i], y[i])]
                        x = [[xi - lr * m for xi, m in zip(x[i], momentum[i])] for i in range(n)]
                    else:
                        y = [_mix(W[i], u) for i in range(n)]
                        momentum = [[beta * m + yi for m, yi in zip(momentum[i], y[i])] for i in range(n)]
                elif mode == "dmsgd":
                    momentum = [[beta * m + ur for m, ur in zip(momentum[r], u[r])] for r in range(n)]
                    z = [[xi - lr * m for xi, m in zip(x[r], momentum[r])] for r in range(n)]
                    x = [_mix(W[i], z) for i in range(n)]
                elif mode == "lsgd":
                    if k % case["period"] == 0:
                        means = [s / c for s, c in period_sums]
                        leader = min(range(n), key=lambda r: (means[r], r))
                        local_leaders = [min(range(g, g + size), key=lambda r: (means[r], r)) for g in range(0, n, size)]
                        targets = {r: x[r] for r in {leader, *local_leaders}}
                        period_sums = [[0.0, 0.0] for _ in range(n)]
                        elections.append((k, leader, local_leaders))
                    momentum = [[beta * m + ur for m, ur in zip(momentum[r], u[r])] for r in range(n)]
                    new = []
                    for r in range(n):
                        step = list(momentum[r])
                        if targets is not None:
                            for strength, target in ((case["pull_global"], leader), (case["pull_local"], local_leaders[r // size])):
                                if strength and target != r:
                                    step = [s + strength * (xi - t) for s, xi, t in zip(step, x[r], targets[target])]
                        new.append([xi - lr * s for xi, s in zip(x[r], step)])
                    x = new
                else:
                    raise ValueError(mode)
        scheduler.step(increment=args.global_batch_size)

    out = {"params": [dict(zip(names, values)) for values in x], "elections": elections}
    if case.get("validate"):
        chosen = range(n) if mode != "lsgd" else [leader if leader is not None else 0]
        load([sum(x[r][i] for r in chosen) / len(chosen) for i in range(len(model))])
        with torch.no_grad():
            starts = range(0, args.eval_iters * args.global_batch_size, args.micro_batch_size)
            totals = [microbatch_loss(net, valid, range(s, s + args.micro_batch_size))[1:] for s in starts]
        out["validation"] = float(sum(t for t, _ in totals) / sum(c for _, c in totals))
    return out


def replay(cases: Dict[str, dict]) -> Dict[str, dict]:
    """Rank body (one rank): :func:`replay_case` of every case. A case: ``argv`` (the model
    and optimizer flags), ``mode``, ``batches`` (:func:`replica_streams`), ``topology``
    (gossip), ``group_size``, ``pull_local``, ``pull_global``, ``period`` (lsgd), ``validate``."""
    return {name: replay_case(case) for name, case in cases.items()}
