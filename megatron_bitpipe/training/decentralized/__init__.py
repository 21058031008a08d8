"""Decentralized data parallelism: DecentLaM, DmSGD and LSGD (multi-leader).

``--data-parallel-mode decentlam | dmsgd | lsgd`` with ``--optimizer sgd``: every data-parallel
replica keeps weights of its own (and its own momentum); instead of the gradient all-reduce,
replicas exchange *parameters* by batched point-to-point messages among the data-parallel
replicas of the same model chunk (the data-parallel group: same tensor- and pipeline-parallel
rank, so BitPipe's weight replicas and every TP shard exchange their own part).

* DecentLaM (Yuan et al., ICCV 2021) — each iteration, with the learning rate γ of the step,
  the local gradient g (clipped per replica, weight decay added) and β = ``--sgd-momentum``:
  ``z = x - γ g``, ``y = Σ_j W_ij z_j`` (the neighbours of ``--gossip-topology``),
  ``m <- β m + (x - y) / γ``, ``x <- x - γ m``. On the complete graph it is synchronous
  momentum SGD.
* DmSGD (decentralized momentum SGD, DecentLaM's baseline): ``m <- β m + g``,
  ``x <- Σ_j W_ij (x_j - γ m_j)``.
* LSGD (Teng et al., NeurIPS 2019), multi-leader: ``x <- x - γ (SGD's momentum step of g)
  - γ (λ_l (x - x_local) + λ_g (x - x_global))`` with the leaders' parameters of the last
  election (every ``--lsgd-period`` iterations: lowest mean training loss over the period,
  in each ``--lsgd-group-size`` group and overall); only leaders send.

Modules: :mod:`.args` (flags, rules; pure Python), :mod:`.topology` (the graphs; pure
Python), :mod:`.methods` (the updates and their exchanges), :mod:`.step` (the training
loop's side: logs, evaluation weights, checkpoints). See ``docs/decentralized.md``.
"""

from .args import DecentralizedSettings, add_decentralized_args, decentralized_problems
from .topology import Topology, topology

__all__ = ["DecentralizedSettings", "add_decentralized_args", "decentralized_problems", "Topology", "topology"]
