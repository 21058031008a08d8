"""The coreset file, what it was made for, and the training flag ``--coreset`` (pure Python).

**File** (one ``.npz``, written by ``scripts/select_coreset.py``, read without pickles):

=================  ==========================================================================
``indices``        int64 [k], ascending: positions in the run's training samples (sample ``p``
                   is the ``p``-th sample the run without a coreset would train on, 0-based)
``gamma``          float64 [k]: how many training samples each stands for; Σγ = ``train_samples``
identity fields    ``data_path``, ``split``, ``seq_length``, ``seed``, ``tokenizer``,
                   ``train_samples`` (:class:`DatasetIdentity`)
``info``           JSON text: fraction, method, proxy, shard size, timings (not checked)
=================  ==========================================================================

**Identity.** Megatron's training samples, and so the indices, are a function of the
``--data-path`` blend, ``--split``, ``--seq-length``, ``--seed``, the tokenizer and the number
of samples the run needs (``--train-iters`` x ``--global-batch-size``: megatron-core's shuffle
depends on the epochs it builds). A run with ``--coreset`` must agree on each; every
disagreement is one problem naming its flag.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Dict, List, Optional

from ...run_config import DataSettings, TokenizerSettings
from ...data_parallel_modes import SYNC, selected_mode
from ..abs_sgd.args import train_samples_of
from ..arguments import data_path_prefixes

if TYPE_CHECKING:  # numpy is imported where a file is read or written: --help and flag errors come without it
    import numpy as np

__all__ = ["CoresetFile", "CoresetSettings", "DatasetIdentity", "add_coreset_args", "coreset_problems", "read_coreset", "write_coreset"]


def _normalised_split(split: str) -> str:
    """``--split`` as megatron-core reads it: shares over their sum, three of them."""
    try:
        shares = [float(s) for s in re.split(r"[\s,/]+", split.strip()) if s]
    except ValueError:
        return split
    shares = (shares + [0.0, 0.0, 0.0])[:3]
    total = sum(shares)
    return ",".join(f"{s / total:.6g}" for s in shares) if total > 0 else split


def _data_path(data: DataSettings, tokenizer: TokenizerSettings) -> str:
    if data.mock:
        return f"mock data, --vocab-size {tokenizer.vocab_size}"
    prefixes = data_path_prefixes(data.paths)
    weights = data.paths[::2] if len(prefixes) * 2 == len(data.paths) else []
    absolute = [os.path.abspath(p) for p in prefixes]
    return " ".join(f"{w} {p}" for w, p in zip(weights, absolute)) if weights else " ".join(absolute)


def _tokenizer(tokenizer: TokenizerSettings) -> str:
    parts = [tokenizer.tokenizer_type or "NullTokenizer", f"vocab_size={tokenizer.vocab_size}"]
    for name in ("vocab_file", "merge_file", "tokenizer_model"):
        if getattr(tokenizer, name):
            parts.append(f"{name}={os.path.abspath(getattr(tokenizer, name))}")
    return " ".join(parts)


@dataclass(frozen=True)
class DatasetIdentity:
    """What fixes a run's training samples (see the module docstring); strings as compared."""

    data_path: str
    split: str
    seq_length: int
    seed: int
    tokenizer: str
    train_samples: int

    #: field -> the flags a user changes to match it
    FLAGS = {
        "data_path": "--data-path",
        "split": "--split",
        "seq_length": "--seq-length",
        "seed": "--seed",
        "tokenizer": "--tokenizer-type/--vocab-size",
        "train_samples": "--train-iters x --global-batch-size (training samples)",
    }

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "DatasetIdentity":
        data, tokenizer = DataSettings.from_args(args), TokenizerSettings.from_args(args)
        return cls(
            data_path=_data_path(data, tokenizer),
            split="mock" if data.mock else _normalised_split(data.split),
            seq_length=int(args.seq_length),
            seed=int(args.seed),
            tokenizer=_tokenizer(tokenizer),
            train_samples=int(train_samples_of(args)),
        )

    def differences(self, other: "DatasetIdentity") -> List[str]:
        """One line per field where ``other`` (this run) differs from ``self`` (the file's)."""
        return [
            f"made for {self.FLAGS[f.name]} {getattr(self, f.name)}, this run has {getattr(other, f.name)}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(other, f.name)
        ]


@dataclass(frozen=True)
class CoresetFile:
    """A coreset: ascending ``indices`` into the training samples, their ``gamma`` (Σ = n)."""

    indices: np.ndarray
    gamma: np.ndarray
    identity: DatasetIdentity
    info: Dict[str, object]

    def loss_weights(self) -> np.ndarray:
        """Per selected sample, the loss weight w_j = γ_j · k / n (float64; mean 1 over the
        coreset). Training cycles through the k samples uniformly, so the expected weighted
        gradient of a drawn sample, (1/k) Σ_j w_j ∇l_j = (1/n) Σ_j γ_j ∇l_j, is the coreset's
        estimate of the full data's mean gradient (1/n) Σ_i ∇l_i. γ = 1, k = n: w = 1 exactly."""
        k, n = len(self.indices), self.identity.train_samples
        return self.gamma * (k / n)


def write_coreset(path: str, coreset: CoresetFile) -> None:
    """Write ``coreset`` to ``path`` (``.npz``; numpy appends the suffix if missing)."""
    import numpy as np

    identity = {name: np.asarray(value) for name, value in asdict(coreset.identity).items()}
    np.savez(
        path,
        indices=np.asarray(coreset.indices, dtype=np.int64),
        gamma=np.asarray(coreset.gamma, dtype=np.float64),
        info=np.asarray(json.dumps(coreset.info)),
        **identity,
    )


def read_coreset(path: str) -> CoresetFile:
    """The coreset in ``path``; ValueError saying what is wrong with the file."""
    import numpy as np

    try:
        with np.load(path, allow_pickle=False) as stored:
            values = {name: stored[name] for name in stored.files}
    except (OSError, ValueError, EOFError) as error:
        raise ValueError(f"cannot read it as a coreset .npz ({error})") from None
    missing = [name for name in ("indices", "gamma", "info", *(f.name for f in fields(DatasetIdentity))) if name not in values]
    if missing:
        raise ValueError(f"not a coreset file (no {', '.join(missing)})")
    identity = DatasetIdentity(
        **{f.name: (int(values[f.name]) if f.type in (int, "int") else str(values[f.name])) for f in fields(DatasetIdentity)}
    )
    indices, gamma = values["indices"].astype(np.int64), values["gamma"].astype(np.float64)
    n = identity.train_samples
    if indices.ndim != 1 or indices.shape != gamma.shape or len(indices) == 0:
        raise ValueError("indices and gamma must be equal-length, non-empty vectors")
    if np.any(np.diff(indices) <= 0) or indices[0] < 0 or indices[-1] >= n:
        raise ValueError(f"indices must ascend within [0, {n})")
    if np.any(gamma <= 0) or not np.isclose(gamma.sum(), n, rtol=1e-9, atol=1e-6):
        raise ValueError(f"gamma must be positive and sum to the {n} training samples (sum {gamma.sum()})")
    return CoresetFile(indices, gamma, identity, json.loads(str(values["info"])))


@dataclass(frozen=True)
class CoresetSettings:
    """``--coreset``, made once from the flags: None, or the file and this run's identity."""

    path: str
    coreset: CoresetFile

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Optional["CoresetSettings"]:
        """None without ``--coreset``; the file, checked by :func:`coreset_problems` before."""
        path = getattr(args, "coreset", None)
        return None if path is None else cls(path, read_coreset(path))

    def summary(self) -> str:
        """The start-up log line of a run on this coreset: what it trains on and how."""
        coreset = self.coreset
        info = coreset.info
        made = ", ".join(f"{key} {info[key]}" for key in ("method", "fraction") if info.get(key) is not None)
        return (
            f"coreset: training on {len(coreset.indices)} of {coreset.identity.train_samples} training samples"
            + (f" ({made})" if made else "")
            + f" from {self.path}, cycled; each sample's loss weighted by the samples it stands for (mean weight 1)"
        )


def add_coreset_args(parser: argparse.ArgumentParser) -> None:
    """The training flag ``--coreset FILE``."""
    parser.add_argument_group(title="coreset (CRAIG)").add_argument(
        "--coreset",
        default=None,
        metavar="FILE.npz",
        help="train on this weighted subset of the training samples (scripts/select_coreset.py): only its "
        "samples, in the order the run would meet them (cycled), each sample's loss weighted by gamma x k / n "
        "(mean 1: the expected gradient is the coreset's estimate of the full data's); default: all samples",
    )


def coreset_problems(args: argparse.Namespace) -> List[str]:
    """Problems with ``--coreset`` for this run (none without it); no communication."""
    path = getattr(args, "coreset", None)
    if path is None:
        return []
    if selected_mode(args) is not SYNC:
        return [f"--coreset needs --data-parallel-mode {SYNC.name} (got {args.data_parallel_mode})"]
    if getattr(args, "hfta_models", None) is not None:
        return ["--coreset cannot be combined with --hfta-models (the fused array's loss does not weight samples)"]
    if not os.path.isfile(path):
        return [f"--coreset {path}: no such file"]
    try:
        coreset = read_coreset(path)
    except ValueError as error:
        return [f"--coreset {path}: {error}"]
    return [f"--coreset {path}: {line}" for line in coreset.identity.differences(DatasetIdentity.from_args(args))]

