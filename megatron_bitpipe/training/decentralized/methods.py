"""The decentralized updates and their parameter exchanges.

Each method is the ``update`` of a :class:`~megatron_bitpipe.optimizers.decentralized_sgd.DecentralizedSGD`
(megatron's wrapper has already clipped this replica's gradient by its own norm). Per
parameter, with γ the group's learning rate, β its momentum, ``u = g + wd x`` (weight decay
coupled as in torch's SGD) and ``m`` the momentum buffer:

* :class:`Gossip` ``decentlam``: ``z = x - γ u``; ``y = Σ_j W_ij z_j``;
  ``m <- β m + (x - y) / γ``; ``x <- x - γ m`` (computed as ``y - γ β m_old``, the same
  value without the cancellation of ``x - y``). At γ = 0 (the first step of a warm-up from
  0) the consensus term ``(x - W x) / γ`` is undefined: the replicas then exchange ``u``
  instead, ``m <- β m + Σ_j W_ij u_j`` and ``x`` stays (the limit γ -> 0 for replicas that
  agree, which they do at the start);
* :class:`Gossip` ``dmsgd``: ``m <- β m + u``; ``x <- Σ_j W_ij (x_j - γ m_j)``;
* :class:`LeaderPull` (LSGD): ``m <- β m + u``;
  ``x <- x - γ m - γ (λ_l (x - x_l) + λ_g (x - x_g))``.

The parameters of all groups travel as one flat vector per message (their order is the
optimizer's, the same on every data-parallel replica of a rank's chunks). Messages go over
the data-parallel group of this rank (same tensor- and pipeline-parallel rank:
:class:`ReplicaLinks`), each exchange one ``batch_isend_irecv`` call with at most one message
per ordered pair of ranks, so it is deadlock-free on NCCL. A gossip average sums the
weighted vectors in replica order, so on the complete graph every replica computes the same
bits.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from megatron.core.transformer.module import param_is_not_shared
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

from ...data_parallel_modes import DMSGD, DataParallelMode
from .args import GOSSIP_MODES
from .topology import Topology

__all__ = ["ReplicaLinks", "Gossip", "LeaderPull", "flat_parameters", "consensus_distance", "elect"]


def _params(optimizer) -> List[Tuple[torch.Tensor, dict]]:
    return [(p, group) for group in optimizer.param_groups for p in group["params"]]


def flat_parameters(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters as one fp32 vector (a copy)."""
    if not params:
        return torch.zeros(0)
    return torch.cat([p.detach().reshape(-1).float() for p in params])


def _unflatten(flat: torch.Tensor, like: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    out, start = [], 0
    for p in like:
        out.append(flat[start : start + p.numel()].view_as(p))
        start += p.numel()
    return out


class ReplicaLinks:
    """Point-to-point messages between this rank and its copies in the other data-parallel
    replicas (same tensor- and pipeline-parallel rank), over the data-parallel group.

    ``groups`` is the model's :class:`~megatron_bitpipe.execution.groups.PipelineGroups`.
    :attr:`bytes_sent` counts every byte this rank sent.
    """

    def __init__(self, groups, device: torch.device):
        self.grid = groups.grid
        self.replica, self.size = groups.dp_rank, groups.grid.dp
        self.group = groups.rank_pgs.dp
        self.tp_rank, self.pp_rank = groups.tp_rank, groups.pp_rank
        self.device = device
        self.bytes_sent = 0

    def global_rank(self, replica: int) -> int:
        return self.grid.rank(self.tp_rank, replica, self.pp_rank)

    def exchange(self, sends: Sequence[Tuple[int, torch.Tensor]], receives: Sequence[Tuple[int, torch.Tensor]]) -> None:
        """Send each ``(replica, tensor)`` of ``sends`` and receive into each of ``receives``,
        as one batch (blocking). Every ordered pair of replicas carries one message at most."""
        ops = [dist.P2POp(dist.isend, t, self.global_rank(r), self.group) for r, t in sends]
        ops += [dist.P2POp(dist.irecv, t, self.global_rank(r), self.group) for r, t in receives]
        if not ops:
            return
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        self.bytes_sent += sum(t.numel() * t.element_size() for _, t in sends)

    def warm_up(self, destinations: Sequence[int], sources: Sequence[int]) -> None:
        """Create the group's communicator and connect this rank's links now (collective over
        the job, at set-up): an all-reduce over the group, then one element per link."""
        dist.all_reduce(torch.zeros(1, device=self.device), group=self.group)
        sent = self.bytes_sent
        self.exchange(
            [(r, torch.zeros(1, device=self.device)) for r in destinations],
            [(r, torch.zeros(1, device=self.device)) for r in sources],
        )
        self.bytes_sent = sent


class Gossip:
    """DecentLaM (``mode`` :data:`~megatron_bitpipe.data_parallel_modes.DECENTLAM`) or DmSGD
    (:data:`~megatron_bitpipe.data_parallel_modes.DMSGD`) over ``topology`` (module
    docstring); callable as a :class:`DecentralizedSGD` update."""

    def __init__(self, mode: DataParallelMode, topology: Topology, links: ReplicaLinks):
        if mode not in GOSSIP_MODES:
            raise ValueError(f"{mode.name} is not a gossip mode ({', '.join(m.name for m in GOSSIP_MODES)})")
        if topology.size != links.size:
            raise ValueError(f"a gossip graph of {topology.size} replicas for {links.size} data-parallel replicas")
        self.mode, self.topology, self.links = mode, topology, links

    def mix(self, vector: torch.Tensor) -> torch.Tensor:
        """``Σ_j W_ij v_j`` for this replica ``i`` (one exchange with the neighbours)."""
        me, graph = self.links.replica, self.topology
        received = {r: torch.empty_like(vector) for r in graph.sources(me)}
        self.links.exchange([(r, vector) for r in graph.destinations(me)], list(received.items()))
        received[me] = vector
        weights = graph.row(me)
        total = torch.zeros_like(vector)
        for r in sorted(received):
            total.add_(received[r], alpha=weights[r])
        return total

    @torch.no_grad()
    def __call__(self, optimizer) -> None:
        pairs = _params(optimizer)
        params = [p for p, _ in pairs]
        states = [optimizer.state[p]["momentum_buffer"] for p in params]
        updates = [p.grad.float() + group["weight_decay"] * p.float() if group["weight_decay"] else p.grad.float() for p, group in pairs]
        if self.mode is DMSGD:
            for (p, group), m, u in zip(pairs, states, updates):
                m.mul_(group["momentum"]).add_(u)
            sent = torch.cat([(p.float() - group["lr"] * m).reshape(-1) for (p, group), m in zip(pairs, states)]) if params else torch.zeros(0)
            for p, y in zip(params, _unflatten(self.mix(sent), params)):
                p.copy_(y)
            return
        # decentlam: z = x - γ u, or u itself where γ = 0
        sent = [(p.float() - group["lr"] * u) if group["lr"] else u for (p, group), u in zip(pairs, updates)]
        flat = torch.cat([v.reshape(-1) for v in sent]) if params else torch.zeros(0)
        for (p, group), m, y in zip(pairs, states, _unflatten(self.mix(flat), params)):
            lr, beta = group["lr"], group["momentum"]
            if lr:
                new_x = y - (lr * beta) * m
                m.mul_(beta).add_((p.float() - y) / lr)
                p.copy_(new_x)
            else:
                m.mul_(beta).add_(y)

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def elect(totals: torch.Tensor, group_size: int) -> Tuple[int, List[int], List[float]]:
    """Leaders from per-replica loss totals ``[n, 2]`` (sum, count): ``(global leader, local
    leader of each group, mean losses)``; the lowest mean wins, ties go to the lower index;
    a replica without losses counts as +inf."""
    means = [float(s / c) if c > 0 else float("inf") for s, c in totals.tolist()]
    best = lambda members: min(members, key=lambda r: (means[r], r))  # noqa: E731
    n = len(means)
    local = [best(range(g, g + group_size)) for g in range(0, n, group_size)]
    return best(range(n)), local, means


class LeaderPull:
    """LSGD, multi-leader (module docstring): callable as a :class:`DecentralizedSGD` update.

    Every ``period`` steps (the step's own training loss included) the replicas' mean losses
    over the period elect a global leader and a local leader per group of ``group_size``
    consecutive replicas, and the leaders send their parameters (before this step's update):
    the global leader to every other replica (if ``pull_global`` > 0), each local leader to
    the other members of its group (if ``pull_local`` > 0; not where the global leader leads
    the group and already sent). Every replica then pulls toward these parameters at every
    step until the next election; a leader's pull toward itself is zero (it pulls toward its
    current weights). No pull before the first election.

    :meth:`observe` adds this rank's loss reports of an iteration (before its step).
    """

    def __init__(self, links: ReplicaLinks, group_size: int, pull_local: float, pull_global: float, period: int, device):
        self.links, self.group_size, self.period = links, group_size, period
        self.pull_local, self.pull_global = pull_local, pull_global
        self.device = device
        self.steps = 0
        #: this rank's (sum, count) of the losses since the last election
        self.totals = torch.zeros(2, dtype=torch.float64)
        self.global_leader: Optional[int] = None
        self.local_leaders: Optional[List[int]] = None
        self.period_losses: Optional[List[float]] = None
        self.elected = False
        self.leader_global: Optional[torch.Tensor] = None  # flat parameters of the leaders (None: it is me)
        self.leader_local: Optional[torch.Tensor] = None

    def observe(self, totals: torch.Tensor) -> None:
        self.totals += totals.to(self.totals)

    def _election(self, params: List[torch.Tensor]) -> None:
        me, n = self.links.replica, self.links.size
        vector = torch.zeros(n, 2, dtype=torch.float64, device=self.device)
        vector[me] = self.totals.to(vector)
        dist.all_reduce(vector)  # every rank of every replica: the job's default group
        self.totals.zero_()
        self.global_leader, self.local_leaders, self.period_losses = elect(vector.cpu(), self.group_size)
        group = me // self.group_size
        leader, local = self.global_leader, self.local_leaders[group]
        members = range(group * self.group_size, (group + 1) * self.group_size)
        mine = flat_parameters(params).to(self.device)
        sends, receives = [], []
        self.leader_global = self.leader_local = None
        if self.pull_global:
            if me == leader:
                sends += [(r, mine) for r in range(n) if r != me]
            else:
                self.leader_global = torch.empty_like(mine)
                receives.append((leader, self.leader_global))
        if self.pull_local and not (self.pull_global and local == leader):
            if me == local:
                sends += [(r, mine) for r in members if r != me]
            else:
                self.leader_local = torch.empty_like(mine)
                receives.append((local, self.leader_local))
        elif self.pull_local and me != local:
            self.leader_local = self.leader_global  # the global leader leads this group
        self.links.exchange(sends, receives)

    @torch.no_grad()
    def __call__(self, optimizer) -> None:
        pairs = _params(optimizer)
        params = [p for p, _ in pairs]
        self.steps += 1
        self.elected = self.steps % self.period == 0
        if self.elected:
            self._election(params)
        pulls = [(self.pull_global, self.leader_global), (self.pull_local, self.leader_local)]
        pulls = [(strength, _unflatten(flat, params)) for strength, flat in pulls if strength and flat is not None]
        for i, ((p, group), m) in enumerate(zip(pairs, [optimizer.state[p]["momentum_buffer"] for p in params])):
            x = p.float()
            u = p.grad.float() + group["weight_decay"] * x if group["weight_decay"] else p.grad.float()
            m.mul_(group["momentum"]).add_(u)
            step = m.clone()
            for strength, leader in pulls:
                step += strength * (x - leader[i])
            p.copy_(x - group["lr"] * step)

    def state_dict(self) -> dict:
        return {
            "steps": self.steps,
            "totals": self.totals.clone(),
            "global_leader": self.global_leader,
            "local_leaders": self.local_leaders,
            "period_losses": self.period_losses,
            "leader_global": None if self.leader_global is None else self.leader_global.cpu(),
            "leader_local": None if self.leader_local is None else self.leader_local.cpu(),
            "local_is_global": self.leader_local is not None and self.leader_local is self.leader_global,
        }

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.totals = state["steps"], state["totals"].clone()
        self.global_leader, self.local_leaders, self.period_losses = state["global_leader"], state["local_leaders"], state["period_losses"]
        move = lambda t: None if t is None else t.to(self.device)  # noqa: E731
        self.leader_global = move(state["leader_global"])
        self.leader_local = self.leader_global if state["local_is_global"] else move(state["leader_local"])


def consensus_distance(optimizer, links: ReplicaLinks) -> float:
    """``sqrt(1/n Σ_i ||x_i - x̄||²)`` over the whole model (each logical parameter once: not
    BitPipe's second weight replica, not a tensor-parallel duplicate); collective over the job
    (an all-reduce of the parameters over the data-parallel group, then of one number)."""
    params = [p for p, _ in _params(optimizer)]
    flat = flat_parameters(params).to(links.device)
    mean = flat.clone()
    dist.all_reduce(mean, group=links.group)
    mean /= links.size
    squares = torch.zeros(1, dtype=torch.float64, device=links.device)
    for p, x, a in zip(params, _unflatten(flat, params), _unflatten(mean, params)):
        if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
            squares += ((x - a).double() ** 2).sum()
    dist.all_reduce(squares)
    return float((squares / links.size).sqrt())
