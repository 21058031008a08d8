"""How many transformer layers each pipeline stage holds: :class:`StageLayers`, from Megatron-LM's
uneven-layout flags (:class:`LayerSplitFlags`) and a :class:`~.placement.Placement`.

Without the flags the layers fill the placement's stages equally
(:meth:`~.placement.Placement.layer_problem` states that rule). The flags mean what they mean in
Megatron-LM, counted over the stages of one pipeline in *pipeline order* (stage ``s`` is the
``s``-th stage a micro-batch passes; for a V placement stages ``0`` and ``2D - 1`` are both on
rank 0; with two pipelines, as in BitPipe and Chimera, both get the same split):

* ``--decoder-first-pipeline-num-layers X`` / ``--decoder-last-pipeline-num-layers Y``: the
  first / last stage holds ``X`` / ``Y`` layers (each ``>= 1``), the other layers fill the
  middle stages equally. On megatron's looped placement with ``v > 1`` chunks per rank
  (interleaved schedule) they count the first / last pipeline *rank*, as megatron-core does:
  each of that rank's ``v`` chunks holds ``X / v`` layers, every middle rank's chunk holds an
  equal share of the rest.
* ``--account-for-embedding-in-pipeline-split`` / ``--account-for-loss-in-pipeline-split``:
  the embedding / the loss counts as one layer; the ``--num-layers`` plus one for each fill all
  stages equally, and the first / last stage holds one transformer layer less (zero layers
  where each stage's share is one).
* ``--pipeline-model-parallel-layout``: megatron's layout string, one entry per stage in
  pipeline order separated by ``|``; ``E`` the embedding (opening the first stage), ``t`` one
  transformer layer, ``L`` the loss (closing the last stage); ``x*n`` repeats one character
  ``n`` times, ``(...)*n`` repeats a group (which may hold ``|``); commas are cosmetic. A stage
  may hold no transformer layer.

The layout excludes the other four; the first / last counts exclude the two
``--account-for-*`` flags (megatron-core's rules). Pure Python, no torch.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

from .errors import VP_FLAG
from .placement import Placement

__all__ = [
    "FIRST_FLAG",
    "HELD_ATTRIBUTE",
    "LAST_FLAG",
    "EMBEDDING_FLAG",
    "LOSS_FLAG",
    "LAYOUT_FLAG",
    "LayerSplitFlags",
    "StageLayers",
    "chunk_layer_counts",
    "parse_layout",
    "split_problems",
    "split_layers",
]

FIRST_FLAG = "--decoder-first-pipeline-num-layers"
LAST_FLAG = "--decoder-last-pipeline-num-layers"
EMBEDDING_FLAG = "--account-for-embedding-in-pipeline-split"
LOSS_FLAG = "--account-for-loss-in-pipeline-split"
LAYOUT_FLAG = "--pipeline-model-parallel-layout"

HELD_ATTRIBUTE = "bitpipe_layer_split"
"""Attribute of a Megatron-LM namespace holding the flags a plan-executed schedule applies
itself, as the dict of a :class:`LayerSplitFlags`'s fields (plain values: Megatron-LM saves its
namespace in checkpoints and loads them weights-only); Megatron-LM's own fields for them are then
unset (:func:`megatron_bitpipe.megatron_lm.args.hold_layer_split`)."""

_GROUP = re.compile(r"\(([^()]*)\)\*(\d+)")
_CHAR = re.compile(r"(.)\*(\d+)")
_LAYOUT_CHARS = {"E", "t", "L", "|"}


@dataclass(frozen=True)
class LayerSplitFlags:
    """Megatron-LM's five uneven-layout flags as given (attribute names are Megatron-LM's
    namespace fields, without the ``decoder_``/``_in_pipeline_split`` parts)."""

    first: Optional[int] = None
    last: Optional[int] = None
    embedding: bool = False
    loss: bool = False
    layout: Optional[str] = None

    @classmethod
    def from_args(cls, args) -> "LayerSplitFlags":
        """The flags of a parsed namespace (either route's; absent fields are unset). Where the
        Megatron-LM route has moved them out of Megatron-LM's fields (:data:`HELD_ATTRIBUTE`),
        the flags held there."""
        held = getattr(args, HELD_ATTRIBUTE, None)
        if held is not None:
            return cls(**held)
        return cls(
            first=getattr(args, "decoder_first_pipeline_num_layers", None),
            last=getattr(args, "decoder_last_pipeline_num_layers", None),
            embedding=bool(getattr(args, "account_for_embedding_in_pipeline_split", False)),
            loss=bool(getattr(args, "account_for_loss_in_pipeline_split", False)),
            layout=getattr(args, "pipeline_model_parallel_layout", None),
        )

    def as_dict(self) -> dict:
        """The fields by name (plain values), as :data:`HELD_ATTRIBUTE` holds them."""
        return asdict(self)

    @property
    def given(self) -> bool:
        """Whether any flag asks for other than equal stages."""
        return self.first is not None or self.last is not None or self.embedding or self.loss or self.layout is not None

    @property
    def names(self) -> List[str]:
        """The flags given, as typed."""
        given = (self.first is not None, self.last is not None, self.embedding, self.loss, self.layout is not None)
        return [flag for flag, on in zip((FIRST_FLAG, LAST_FLAG, EMBEDDING_FLAG, LOSS_FLAG, LAYOUT_FLAG), given) if on]


@dataclass(frozen=True)
class StageLayers:
    """Transformer layers of each stage of one pipeline, in pipeline order.

    Invariant: every count is ``>= 0``. Stage ``s`` holds the global (0-based) layers
    ``[first_layer(s), first_layer(s) + counts[s])``; every pipeline of a placement holds the
    same split.
    """

    counts: Tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.counts or any(c < 0 for c in self.counts):
            raise ValueError(f"layers per stage must be >= 0 for at least one stage, got {self.counts}")

    @classmethod
    def even(cls, num_layers: int, num_stages: int) -> "StageLayers":
        """``num_layers`` over ``num_stages`` equal stages (``num_stages`` must divide it)."""
        if num_stages < 1 or num_layers % num_stages:
            raise ValueError(f"{num_layers} layers do not fill {num_stages} equal stages")
        return cls((num_layers // num_stages,) * num_stages)

    @property
    def num_layers(self) -> int:
        return sum(self.counts)

    @property
    def num_stages(self) -> int:
        return len(self.counts)

    @property
    def is_even(self) -> bool:
        return len(set(self.counts)) == 1

    def first_layer(self, stage: int) -> int:
        """Global (0-based) index of stage ``stage``'s first layer."""
        return sum(self.counts[:stage])

    def __str__(self) -> str:
        return ",".join(map(str, self.counts))


def parse_layout(layout: str) -> List[str]:
    """The stages of a layout string, each a string of ``E``/``t``/``L`` (repetitions expanded,
    commas and spaces dropped). ValueError naming the flag for a character other than
    ``E``, ``t``, ``L``, ``|``, ``(``, ``)``, ``*``, digits and commas."""
    text = layout.replace(",", "").replace(" ", "")
    text = _GROUP.sub(lambda m: m.group(1) * int(m.group(2)), text)
    text = _CHAR.sub(lambda m: m.group(1) * int(m.group(2)), text)
    unknown = sorted(set(text) - _LAYOUT_CHARS)
    if unknown:
        what = "'m' (multi-token prediction layers) is not supported" if unknown == ["m"] else (
            f"unknown characters {''.join(unknown)!r} (E embedding, t transformer layer, L loss, | between stages, "
            "x*n and (...)*n repeat)"
        )
        raise ValueError(f"{LAYOUT_FLAG} {layout!r}: {what}")
    return text.split("|")


def _stages_phrase(placement: Placement, virtual_size_flag: str) -> str:
    sizes = placement.stage_count_flags(virtual_size_flag)
    return f"the {placement.name} placement runs {sizes} = {placement.num_stages} stages per pipeline"


def _interleaved_chunks(placement: Placement) -> int:
    """Chunks per rank over which megatron's first/last counts are shared (its looped
    placement's virtual size; 1 for every other placement, whose counts are per stage)."""
    return placement.chunks_per_rank if placement.name == "looped" else 1


def _layout_counts(flags: LayerSplitFlags, placement: Placement, num_layers: int, vflag: str):
    try:
        stages = parse_layout(flags.layout)
    except ValueError as error:
        return None, [str(error)]
    problems = []
    if len(stages) != placement.num_stages:
        problems.append(f"{LAYOUT_FLAG} has {len(stages)} stages, but {_stages_phrase(placement, vflag)}")
    joined = "".join(stages)
    if joined.count("E") != 1 or not stages[0].startswith("E"):
        problems.append(f"{LAYOUT_FLAG}: E (the embedding) must open the first stage, once")
    if joined.count("L") != 1 or not stages[-1].endswith("L"):
        problems.append(f"{LAYOUT_FLAG}: L (the loss) must close the last stage, once")
    if joined.count("t") != num_layers:
        problems.append(f"{LAYOUT_FLAG} holds {joined.count('t')} transformer layers (t), --num-layers {num_layers}")
    return tuple(stage.count("t") for stage in stages), problems


def _first_last_counts(flags: LayerSplitFlags, placement: Placement, num_layers: int, vflag: str):
    problems = []
    for flag, value in ((FIRST_FLAG, flags.first), (LAST_FLAG, flags.last)):
        if value is not None and value < 1:
            problems.append(f"{flag} must be >= 1 (got {value})")
    if problems:
        return None, problems
    chunks = _interleaved_chunks(placement)
    units = placement.num_stages // chunks  # stages, or ranks of megatron's interleaved schedule
    unit = "rank" if chunks > 1 else "stage"
    given = [(flag, value) for flag, value in ((FIRST_FLAG, flags.first), (LAST_FLAG, flags.last)) if value is not None]
    if chunks > 1:
        problems += [
            f"{flag} {value} must be divisible by {vflag} {chunks} (each of that {unit}'s {chunks} chunks holds an equal share)"
            for flag, value in given if value % chunks
        ]
    middle = units - len(given)
    rest = num_layers - sum(value for _, value in given)
    named = " + ".join(f"{flag} {value}" for flag, value in given)
    if middle < 0:
        problems.append(f"{FIRST_FLAG} and {LAST_FLAG} need at least 2 stages per pipeline: {_stages_phrase(placement, vflag)}")
    elif rest < 0 or (middle == 0 and rest) or (middle and (rest == 0 or rest % (middle * chunks))):
        need = f"equal to --num-layers {num_layers}" if middle == 0 else (
            f"less than --num-layers {num_layers}, leaving a multiple of {middle * chunks} layers for the {middle} middle "
            f"{unit}{'s' if middle != 1 else ''}" + (f" x {chunks} chunks" if chunks > 1 else "")
        )
        problems.append(f"{named} = {num_layers - rest} must be {need} ({_stages_phrase(placement, vflag)})")
    if problems:
        return None, problems
    per_middle = rest // (middle * chunks) if middle else 0
    first = flags.first // chunks if flags.first is not None else per_middle
    last = flags.last // chunks if flags.last is not None else per_middle

    def layers(stage: int) -> int:
        position = stage % units  # stage of the pipeline, or rank of the interleaved schedule
        return first if position == 0 else last if position == units - 1 else per_middle

    return tuple(layers(s) for s in range(placement.num_stages)), []


def _accounted_counts(flags: LayerSplitFlags, placement: Placement, num_layers: int, vflag: str):
    stages = placement.num_stages
    total = num_layers + int(flags.embedding) + int(flags.loss)
    if total % stages:
        counted = " + ".join([f"--num-layers {num_layers}"] + [f"1 ({f})" for f in (EMBEDDING_FLAG, LOSS_FLAG) if f in flags.names])
        return None, [f"{counted} = {total} must be divisible by the stages: {_stages_phrase(placement, vflag)}"]
    counts = [total // stages] * stages
    counts[0] -= int(flags.embedding)
    counts[-1] -= int(flags.loss)
    if min(counts) < 0:  # one stage holding both the embedding and the loss, and no layer
        return None, [f"--num-layers {num_layers} leaves a stage without room for the embedding and the loss"]
    return tuple(counts), []


def _counts(flags: LayerSplitFlags, placement: Placement, num_layers: int, vflag: str):
    if flags.layout is not None:
        others = [name for name in flags.names if name != LAYOUT_FLAG]
        if others:
            return None, [f"{LAYOUT_FLAG} gives every stage's layers: it cannot be combined with {', '.join(others)}"]
        return _layout_counts(flags, placement, num_layers, vflag)
    if flags.first is not None or flags.last is not None:
        if flags.embedding or flags.loss:
            counts_given = " and ".join(n for n in (FIRST_FLAG, LAST_FLAG) if n in flags.names)
            accounted = " and ".join(n for n in (EMBEDDING_FLAG, LOSS_FLAG) if n in flags.names)
            return None, [f"{counts_given} cannot be combined with {accounted} (megatron-core's rule)"]
        return _first_last_counts(flags, placement, num_layers, vflag)
    if flags.embedding or flags.loss:
        return _accounted_counts(flags, placement, num_layers, vflag)
    problem = placement.layer_problem(num_layers, vflag)
    return (None, [problem]) if problem else (StageLayers.even(num_layers, placement.num_stages).counts, [])


def split_problems(flags: LayerSplitFlags, placement: Placement, num_layers: int, virtual_size_flag: str = VP_FLAG) -> List[str]:
    """Every rule ``flags`` break for ``num_layers`` layers on ``placement``, one line each naming
    the flag (the equal-stage rule of :meth:`~.placement.Placement.layer_problem` without flags);
    ``[]`` if none. ``virtual_size_flag`` names the virtual pipeline size's flag."""
    return _counts(flags, placement, num_layers, virtual_size_flag)[1]


def split_layers(flags: LayerSplitFlags, placement: Placement, num_layers: int, virtual_size_flag: str = VP_FLAG) -> StageLayers:
    """The layers of each of ``placement``'s stages (pipeline order) the flags ask for; ValueError
    with the first broken rule (:func:`split_problems`)."""
    counts, problems = _counts(flags, placement, num_layers, virtual_size_flag)
    if problems:
        raise ValueError(problems[0])
    return StageLayers(counts)


def chunk_layer_counts(
    flags: LayerSplitFlags, placement: Optional[Placement], num_layers: int, stages: int, virtual_size_flag: str = VP_FLAG
) -> List[int]:
    """The distinct non-zero numbers of layers a chunk holds (ascending), for the rules that
    depend on them (activation recompute): those of the split the flags give on ``placement``
    where it holds, else ``num_layers`` over ``stages`` equal stages (at least 1)."""
    if flags.given and placement is not None and not split_problems(flags, placement, num_layers, virtual_size_flag):
        return sorted({c for c in split_layers(flags, placement, num_layers, virtual_size_flag).counts if c})
    return [max(num_layers // stages, 1)]
