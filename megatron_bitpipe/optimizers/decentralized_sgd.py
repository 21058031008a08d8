"""SGD's state and hyper-parameters with a step that a decentralized data-parallel method supplies.

:class:`DecentralizedSGD` is what ``--optimizer sgd`` builds in a decentralized data-parallel
mode (``--data-parallel-mode decentlam | dmsgd | lsgd``): the parameter groups, learning rate,
weight decay and momentum of torch's ``SGD`` (``momentum_buffer`` per parameter, as torch
keeps it; no dampening, no Nesterov), inside megatron's wrappers like any optimizer of this
package (clipping, the grad norm and mixed precision stay megatron's). Its ``step`` calls the
``update`` the training loop attaches (:mod:`megatron_bitpipe.training.decentralized`), which
exchanges parameters with other data-parallel replicas; there is no step without one.

:func:`init_sgd_state` is the state initialiser megatron-core's own SGD lacks: megatron calls
the optimizer's ``init_state_fn`` before loading a checkpoint's optimizer state, and SGD's
momentum buffers only exist after a first step, so without it a resumed run would not ask for
them. A zero buffer gives the same first step as torch's lazily created one (``0·β + g = g``).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

__all__ = ["DecentralizedSGD", "init_sgd_state"]


def init_sgd_state(optimizer: torch.optim.Optimizer, config=None) -> None:
    """Give every parameter of a group with momentum a zero ``momentum_buffer`` if it has none
    (megatron's ``init_state_fn`` signature)."""
    for group in optimizer.param_groups:
        if group.get("momentum", 0.0) == 0.0 and not isinstance(optimizer, DecentralizedSGD):
            continue
        for param in group["params"]:
            if optimizer.state[param].get("momentum_buffer") is None:
                optimizer.state[param]["momentum_buffer"] = torch.zeros_like(param)


class DecentralizedSGD(torch.optim.Optimizer):
    """Torch SGD's groups and state; :meth:`step` is ``update(self)`` (set by the caller).

    Every parameter has a ``momentum_buffer`` from the first step (or checkpoint load) on,
    also with momentum 0, so that a decentralized method's state is the same whatever β.
    """

    def __init__(self, params, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must lie in [0, 1), got {momentum}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))
        #: the method's update, ``update(optimizer)``; see the module docstring
        self.update: Optional[Callable[["DecentralizedSGD"], None]] = None

    def init_state(self, config=None) -> None:
        """Zero momentum buffers where there are none (megatron's ``init_state_fn``)."""
        init_sgd_state(self, config)

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("DecentralizedSGD takes no closure")
        if self.update is None:
            raise RuntimeError(
                "DecentralizedSGD has no update attached: the decentralized data-parallel step "
                "(megatron_bitpipe.training.decentralized) attaches it before training"
            )
        self.init_state()
        self.update(self)
