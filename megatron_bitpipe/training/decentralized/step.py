"""The decentralized modes inside the pretraining loop: :class:`DecentralizedStrategy`.

An iteration is the synchronous one (:class:`~megatron_bitpipe.training.sync.SyncStrategy`)
with three differences: the chunks' DDP averages gradients only within a data-parallel replica
(BitPipe's weight replicas), the optimizer's step is the mode's update
(:mod:`.methods`, attached to :class:`~megatron_bitpipe.optimizers.decentralized_sgd.DecentralizedSGD`
here), and LSGD sees each iteration's training losses before the step
(:meth:`DecentralizedStrategy.before_optimizer_step`).
The logged loss is the mean over all replicas' batches, each at its own weights; the grad norm
is replica 0's (each replica clips its own gradient).

**Logs** (``IterationRecord.extra``): ``comm_bytes_per_replica``, the bytes the data-parallel
update sent in the iteration, per replica (all its ranks; averaged over the replicas: LSGD's
leaders send, the others do not; the 16-byte loss all-reduce of an election not counted);
``consensus_distance``, ``sqrt(1/n Σ_i ||x_i - x̄||²)`` over the whole model after the update,
on iterations that are multiples of ``--log-interval`` (None otherwise: it costs an all-reduce
of the parameters); LSGD also ``lsgd_elected`` (whether the iteration held an election),
``lsgd_global_leader``, ``lsgd_local_leaders`` (one per group) and, at an election,
``lsgd_period_losses`` (each replica's mean training loss over the period).

**Evaluation** (:meth:`DecentralizedStrategy.evaluated_weights`): decentlam and dmsgd evaluate the
average of the replicas' weights, lsgd the global leader's current weights (replica 0 before the
first election); the training weights are restored bit for bit afterwards. An iteration with an
evaluation logs ``evaluated_weights``.

**Checkpoints**: megatron's checkpoint holds data-parallel replica 0's model and optimizer
state (the replicas' copies are not compared when saving); every rank also writes its own
fp32 main weights, momentum buffers and the method's state (``decentralized_rank<r>.pt``) and
rank 0 the mode, its settings and the layout (``decentralized.json``), so a resume in the same
layout and mode continues every replica exactly. ``--no-load-optim`` / ``--finetune`` take
each replica's weights only.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Dict, Iterator, List, Optional

import torch
import torch.distributed as dist
from megatron.core.utils import unwrap_model

from ...data_parallel_modes import DECENTLAM, DMSGD, LSGD, DataParallelMode
from ...optimizers import megatron_parts
from ...optimizers.decentralized_sgd import DecentralizedSGD
from ..distributed import log
from ..checkpoint import rank_layout
from ...checkpoint_rules import CheckpointError
from ..mode import TrainingParts
from ..rank_state import RankStateFiles
from ..sync import SyncStrategy
from .args import DecentralizedSettings
from .methods import Gossip, LeaderPull, ReplicaLinks, consensus_distance, flat_parameters
from .topology import topology

__all__ = ["DecentralizedStrategy", "COMMON_FILE"]

#: a decentralized mode's state next to a checkpoint: every replica's weights, momentum and method state
STATE_FILES = RankStateFiles("decentralized", version=1)
COMMON_FILE = STATE_FILES.common_file


class DecentralizedStrategy(SyncStrategy):
    """A decentralized mode's iteration, evaluated weights and checkpoints (collective
    construction: warms up the data-parallel links)."""

    modes = (DECENTLAM, DMSGD, LSGD)
    state_files = STATE_FILES

    def __init__(self, mode: DataParallelMode, parts: TrainingParts):
        super().__init__(mode, parts)
        self.settings = s = DecentralizedSettings.from_args(parts.args)
        optimizer_parts = megatron_parts(parts.optimizer)
        if len(optimizer_parts) != 1 or not isinstance(optimizer_parts[0].optimizer, DecentralizedSGD):
            raise TypeError(f"--data-parallel-mode {s.mode} needs the optimizer built for it (--optimizer sgd)")
        self.part, self.inner = optimizer_parts[0], optimizer_parts[0].optimizer
        device = parts.env.device
        self.links = links = ReplicaLinks(parts.model.groups, device)
        me, n = links.replica, links.size
        if s.gossip:
            self.graph = topology(s.topology, n)
            self.method = Gossip(mode, self.graph, links)
            links.warm_up(self.graph.destinations(me), self.graph.sources(me))
        else:
            self.graph = None
            self.method = LeaderPull(links, s.group_size, s.pull_local, s.pull_global, s.period, device)
            links.warm_up([], [])
        self.inner.update = self.method
        local = sum(p.numel() for g in self.inner.param_groups for p in g["params"]) * 4  # fp32 messages
        total = torch.tensor([local], dtype=torch.float64, device=device)
        dist.all_reduce(total)
        #: bytes of one replica's parameters as they travel (all its ranks, BitPipe's weight replicas included)
        self.replica_bytes = int(total.item()) // n
        self.loss_name = parts.loss_names[0]
        log(f"{s.mode}: {self._description()}; evaluation uses {self.evaluated_label()}")

    def _description(self) -> str:
        s, n = self.settings, self.links.size
        if self.graph is not None:
            return (
                f"{n} replicas on the {s.topology} graph (each averages with {self.graph.degree} neighbours, "
                f"{self.graph.degree * self.replica_bytes} bytes sent per replica and iteration), momentum {s.momentum}"
            )
        return (
            f"{n} replicas in groups of {s.group_size}, pulls λ_local {s.pull_local} and λ_global {s.pull_global} "
            f"toward the leaders elected every {s.period} iterations, momentum {s.momentum}"
        )

    # -- one iteration ----------------------------------------------------------------------

    def before_optimizer_step(self, reports: List[Dict[str, torch.Tensor]]) -> None:
        """LSGD observes this rank's share of the iteration's training losses (``[sum, count]``
        of the model kind's first loss, on tensor-parallel rank 0 of a loss rank)."""
        if not isinstance(self.method, LeaderPull):
            return
        totals = torch.zeros(2, dtype=torch.float64)
        if self.parts.model.groups.tp_rank == 0:
            for report in reports:
                totals += report[self.loss_name].detach().to(totals)
        self.method.observe(totals)

    def _comm_bytes(self) -> float:
        if self.graph is not None:
            return float(self.graph.degree * self.replica_bytes)
        m = self.method
        if not m.elected:
            return 0.0
        n, size = self.links.size, m.group_size
        messages = (n - 1) if m.pull_global else 0
        if m.pull_local:
            messages += sum(size - 1 for leader in m.local_leaders if not (m.pull_global and leader == m.global_leader))
        return messages * self.replica_bytes / n

    def iteration_fields(self, iteration: int) -> Dict[str, object]:
        """The iteration record's fields after the step (collective on logging iterations:
        the consensus distance)."""
        interval = self.parts.run.logging.interval
        due = bool(interval) and iteration % interval == 0
        out: Dict[str, object] = {
            "comm_bytes_per_replica": self._comm_bytes(),
            "consensus_distance": consensus_distance(self.inner, self.links) if due else None,
        }
        m = self.method
        if isinstance(m, LeaderPull):
            out.update(
                lsgd_elected=m.elected,
                lsgd_global_leader=m.global_leader,
                lsgd_local_leaders=m.local_leaders,
                lsgd_period_losses=m.period_losses if m.elected else None,
            )
        return out

    # -- evaluation -------------------------------------------------------------------------

    def evaluation_fields(self) -> Dict[str, object]:
        """``evaluated_weights``: which weights the evaluation used."""
        return {"evaluated_weights": self.evaluated_label()}

    def evaluated_label(self) -> str:
        if self.graph is not None:
            return f"the average of the {self.links.size} replicas' weights"
        leader = self.method.global_leader
        return "replica 0's weights (no leader elected yet)" if leader is None else f"the global leader's weights (replica {leader})"

    @contextlib.contextmanager
    def evaluated_weights(self) -> Iterator[None]:
        """Inside: every replica's model holds the evaluated weights (the average, or the
        global leader's); afterwards its own again, bit for bit. Collective."""
        params = [p for chunk in self.parts.model.chunks for p in unwrap_model(chunk).parameters()]
        saved = [p.detach().clone() for p in params]
        flat = flat_parameters(params).to(self.links.device)
        if self.graph is not None:
            dist.all_reduce(flat, group=self.links.group)
            flat /= self.links.size
        else:
            leader = self.method.global_leader or 0
            dist.broadcast(flat, src=self.links.global_rank(leader), group=self.links.group)
        start = 0
        with torch.no_grad():
            for p in params:
                p.copy_(flat[start : start + p.numel()].view_as(p))
                start += p.numel()
        try:
            yield
        finally:
            with torch.no_grad():
                for p, value in zip(params, saved):
                    p.copy_(value)

    # -- checkpoints ------------------------------------------------------------------------

    def _params(self) -> List[torch.Tensor]:
        return [p for group in self.inner.param_groups for p in group["params"]]

    def save(self, directory: str) -> None:
        """Write this rank's replica state into checkpoint ``directory`` (before the
        checkpoint itself, which makes it the latest)."""
        params = self._params()
        state = {
            "params": [p.detach().cpu().clone() for p in params],
            "momentum": [self.inner.state[p]["momentum_buffer"].detach().cpu().clone() for p in params],
            "method": self.method.state_dict(),
        }
        common = {"mode": self.settings.mode, "settings": dataclasses.asdict(self.settings)}
        STATE_FILES.save(directory, self.parts.env.rank, rank_layout(self.parts.run), common, state)

    def resume(self, directory: str, common: Optional[dict]) -> None:
        """Restore the state :meth:`save` wrote (``common``: its ``decentralized.json``); from
        a checkpoint without it (one model) every replica starts from that model.
        CheckpointError naming the flags when this run cannot continue it."""
        mode = self.settings.mode
        if common is None:
            log(f"{mode}: {directory} holds one model; every replica starts from it")
            return
        if common["mode"] != mode:
            raise CheckpointError(f"{directory} was saved with --data-parallel-mode {common['mode']}: resume it with that mode, not {mode}")
        if common["layout"] != rank_layout(self.parts.run):
            raise CheckpointError(
                f"{directory} holds the {common['mode']} replicas of another layout ({common['layout']}); resume it with the "
                "same world size, --tensor-model-parallel-size, --pipeline-model-parallel-size, schedule and --tensor-parallel-mode"
            )
        state = STATE_FILES.load_rank(directory, self.parts.env.rank)
        params = self._params()
        shapes = [tuple(p.shape) for p in params]
        if [tuple(t.shape) for t in state["params"]] != shapes:
            raise CheckpointError(f"{directory}: the saved replica parameters do not fit this model's optimizer parameters")
        weights_only = self.parts.run.checkpointing.weights_only
        with torch.no_grad():
            for p, value, momentum in zip(params, state["params"], state["momentum"]):
                p.copy_(value)
                if not weights_only:
                    self.inner.state[p]["momentum_buffer"] = momentum.to(p.device, p.dtype)
        copy = getattr(self.part, "_copy_main_params_to_model_params", None)
        if copy is not None:
            copy()
        if not weights_only:
            self.method.load_state_dict(state["method"])
        log(f"{mode}: resumed every replica's weights" + ("" if weights_only else ", momentum and method state") + f" from {directory}")


    @classmethod
    def refusal(cls, directory: str, common: dict) -> str:
        """Another mode cannot load a decentralized checkpoint: it holds replica 0's model only."""
        return (
            f"{directory} was saved with --data-parallel-mode {common['mode']} (every data-parallel replica has weights of "
            f"its own; the checkpoint's model is replica 0's): resume it with --data-parallel-mode {common['mode']}"
        )
