"""1-bit compression with error feedback, and the two-phase compressed averaging.

**Compressor.** :func:`compress` turns a fp32 vector ``c`` of ``n`` elements into one scale
``s = ||c|| / sqrt(n)`` and one bit per element (``c >= 0``; zero counts as positive), the
value ``s * sign(c)`` it stands for, and the error ``e = c - s * sign(c)`` (exactly that fp32
expression). Feeding ``e`` back into the next vector of the same stream (error feedback)
makes the compression error of the running sum bounded instead of growing.
:func:`pack_bits` / :func:`unpack_bits` store 8 bits per byte (element ``8j + i`` in bit
``i`` of byte ``j``), in plain torch.

**Averaging over a group of W ranks** (:class:`CompressedAverager`, the scheme of 1-bit
Adam/LAMB, Tang et al. 2021, Li et al. 2021), for a vector of ``n`` elements, ``n`` a
multiple of ``8 W`` (:func:`padded_size`); rank ``r`` owns share ``r`` (elements
``[r n/W, (r+1) n/W)``):

1. *worker*: every rank compresses its vector plus its worker error (one scale for the whole
   vector) and sends share ``j`` of the bits to rank ``j`` with its scale
   (``all_to_all_single`` of ``W x (n/8W + 4)`` bytes);
2. *server*: rank ``r`` decodes the W copies of its share, averages them
   (``sum_i (s_i / W) sign_i``, in rank order), adds its server error and compresses the
   result again (one scale for the share);
3. every rank gathers every server's bits and scale (``all_gather`` of ``n/8W + 4`` bytes
   each) and decodes the whole vector.

Every rank decodes the same bytes with the same operations, so the result is bitwise
identical on all ranks. One fp32 all-reduce moves about ``2 (W-1)/W * 4n`` bytes per rank,
this about ``2 (W-1)/W * n/8``: 1/32 of it, plus ``8 W`` bytes of scales.
:func:`average_in_process` computes the same result for W vectors in one process (the
reference the multi-rank tests compare against).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = [
    "pack_bits",
    "unpack_bits",
    "compress",
    "padded_size",
    "CompressedAverager",
    "average_in_process",
]

_SCALE_BYTES = 4  # one fp32 scale travels as 4 bytes after the bits


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """uint8 ``[n/8]`` from bool ``[n]`` (``n`` a multiple of 8)."""
    if bits.numel() % 8:
        raise ValueError(f"cannot pack {bits.numel()} bits into whole bytes")
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=bits.device)
    return (bits.reshape(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """bool ``[8 n]`` from uint8 ``[n]``; inverse of :func:`pack_bits`."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    return ((packed.reshape(-1, 1) >> shifts) & 1).reshape(-1).bool()


def _signs(bits: torch.Tensor) -> torch.Tensor:
    """+1.0 where ``bits`` is set, -1.0 elsewhere (fp32)."""
    return bits.float().mul_(2.0).sub_(1.0)


def compress(c: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(scale, bits, error)`` of fp32 vector ``c``: ``scale = ||c|| / sqrt(n)`` (0-d),
    ``bits = c >= 0``, ``error = c - scale * sign(c)``."""
    scale = torch.linalg.vector_norm(c) / math.sqrt(c.numel())
    bits = c >= 0
    return scale, bits, c - scale * _signs(bits)


def padded_size(numel: int, world: int) -> int:
    """Smallest multiple of ``8 * world`` that holds ``numel`` elements."""
    unit = 8 * world
    return -(-numel // unit) * unit


def _with_scale(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.cat([packed, scale.reshape(1).to(torch.float32).view(torch.uint8)])


def _split_scale(rows: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """bits ``[W, k]`` and fp32 scales ``[W]`` of rows of ``k + 4`` bytes."""
    return rows[:, :-_SCALE_BYTES], rows[:, -_SCALE_BYTES:].contiguous().view(torch.float32).reshape(-1)


def _decode(rows: torch.Tensor) -> torch.Tensor:
    """``[W, k]`` rows of bits + scale -> fp32 ``[W, 8k]`` of ``scale_i * sign``."""
    bits, scales = _split_scale(rows)
    return _signs(unpack_bits(bits)).reshape(rows.shape[0], -1).mul_(scales.reshape(-1, 1))


def _server_average(rows: torch.Tensor, world: int) -> torch.Tensor:
    """``sum_i (s_i / W) sign_i`` of the W workers' copies of one share, in rank order."""
    bits, scales = _split_scale(rows)
    signs = _signs(unpack_bits(bits)).reshape(world, -1)
    return signs.mul_((scales / world).reshape(-1, 1)).sum(dim=0)


class CompressedAverager:
    """Compressed averaging of one fixed-size fp32 vector over ``group``, with this rank's
    worker error (``[n]``) and server error (``[n / W]``); see the module docstring.

    :meth:`start` posts phase 1 asynchronously; :meth:`finish` completes it, runs the
    server step and phase 2, and returns the average (identical bits on every rank). The
    errors persist across calls (they are the optimizer state of the stream).
    """

    def __init__(self, numel: int, group: dist.ProcessGroup, device: Optional[torch.device] = None):
        self.group = group
        self.world = group.size()
        if numel % (8 * self.world):
            raise ValueError(f"compressed vectors need a multiple of 8 x {self.world} elements, got {numel}")
        self.numel = numel
        self.worker_error = torch.zeros(numel, device=device)
        self.server_error = torch.zeros(numel // self.world, device=device)
        self._pending = None

    def start(self, vector: torch.Tensor) -> None:
        if self._pending is not None:
            raise RuntimeError("a compressed average is already in flight")
        scale, bits, self.worker_error = compress(vector + self.worker_error)
        packed = pack_bits(bits).reshape(self.world, -1)
        send = torch.cat([packed, scale.reshape(1).to(torch.float32).view(torch.uint8).expand(self.world, -1)], dim=1)
        received = torch.empty_like(send)
        handle = dist.all_to_all_single(received, send, group=self.group, async_op=True)
        self._pending = (handle, received, send)

    def finish(self) -> torch.Tensor:
        if self._pending is None:
            raise RuntimeError("finish() without start()")
        handle, received, _ = self._pending
        self._pending = None
        handle.wait()
        scale, bits, self.server_error = compress(_server_average(received, self.world) + self.server_error)
        mine = _with_scale(pack_bits(bits), scale)
        rows = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(rows, mine, group=self.group)
        return _decode(torch.stack(rows)).reshape(-1)

    @property
    def in_flight(self) -> bool:
        return self._pending is not None


def average_in_process(
    vectors: Sequence[torch.Tensor], worker_errors: List[torch.Tensor], server_errors: List[torch.Tensor]
) -> torch.Tensor:
    """What :class:`CompressedAverager` returns on W ranks holding ``vectors[i]``, computed in
    one process; updates the lists of errors (rank ``i``'s at index ``i``) in place."""
    world = len(vectors)
    packed, scales = [], []
    for i, vector in enumerate(vectors):
        scale, bits, worker_errors[i] = compress(vector + worker_errors[i])
        packed.append(pack_bits(bits).reshape(world, -1))
        scales.append(scale)
    shares = []
    for r in range(world):
        rows = torch.stack([_with_scale(packed[i][r], scales[i]) for i in range(world)])
        scale, bits, server_errors[r] = compress(_server_average(rows, world) + server_errors[r])
        shares.append(_with_scale(pack_bits(bits), scale))
    return _decode(torch.stack(shares)).reshape(-1)
