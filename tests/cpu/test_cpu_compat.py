"""megatron-core's own pipeline schedules on CPU ranks equal single-process training.

One reference launch trains the tiny GPT on a single rank (plain forward/backward loop,
megatron DDP and Adam) and records the initial weights. One 4-rank launch then trains the
same model, from the same weights on the same global batches, with megatron-core's 1F1B
and interleaved schedules on several layouts. Per step, the per-micro-batch losses, the
gradients after ``finalize_model_grads``, the clipped grad norm and the weights after the
optimizer step must match the reference in fp32: bit for bit for pure pipelining, to
rtol 1e-5 / atol 1e-6 where the layout changes the rounding (see ``Case.exact``).

Also: what the compatibility layer does (on a rank of its own, never in the pytest
process), and which code may import ``megatron_bitpipe.testing`` and the CPU layer.
Megatron-core is imported only in the launched ranks.
"""

from __future__ import annotations

import re

import functools
from dataclasses import dataclass
from typing import Dict, List, Optional

import pytest
import torch

from megatron_bitpipe.cpu.launcher import launch
from megatron_bitpipe.testing.weights import merge_full

# The tiny GPT, Adam settings and tolerance (for layouts whose float operations differ from
# the reference's, see Case.exact) of every runtime test.
from ..equivalence_support import ADAM_EPS, ATOL, LR, MICRO_BATCH, RTOL, SEQ, VOCAB, model_config

NUM_MICROBATCHES = 8  # global batch, split over data-parallel ranks
STEPS = 3
SEED = 1234
# Below the gradient norm (~1 here): with clipping on, megatron's clip path runs every step.
CLIP_GRAD = 0.5


@dataclass(frozen=True)
class Case:
    """One training layout; ``vp`` selects the interleaved schedule.

    ``batch_p2p`` is megatron's default ``batch_p2p_comm=True``; it is only correct when the
    previous and next pipeline ranks differ (it swaps the two directions at pp = 2).
    ``overlap_p2p`` is the interleaved schedule as Megatron-LM configures it by default:
    ``overlap_p2p_comm`` (unbatched, asynchronous p2p) with ``deallocate_pipeline_outputs``.
    """

    name: str
    tp: int = 1
    dp: int = 1
    pp: int = 1
    vp: Optional[int] = None
    tied: bool = False
    clip: bool = False
    batch_p2p: bool = False
    overlap_p2p: bool = False

    @property
    def exact(self) -> bool:
        """Pure pipelining does the reference's float operations in the reference's order.

        Tied embeddings (two partial gradients summed), data or tensor parallelism (other
        reduction orders) and clipping (a grad norm summed per rank) change the rounding.
        """
        return not (self.tied or self.clip or self.dp > 1 or self.tp > 1)

    @property
    def reference(self) -> "Case":
        return Case(f"reference_tied{self.tied}_clip{self.clip}", tied=self.tied, clip=self.clip)


CASES = [
    Case("1f1b_pp4_batch_p2p", pp=4, batch_p2p=True),
    Case("interleaved_pp4_vp2_batch_p2p", pp=4, vp=2, batch_p2p=True),
    Case("interleaved_pp4_vp2_overlap_p2p", pp=4, vp=2, overlap_p2p=True),
    Case("1f1b_pp2_dp2_clip", pp=2, dp=2, clip=True),
    Case("interleaved_pp2_vp2_dp2_tied", pp=2, vp=2, dp=2, tied=True),
    Case("1f1b_pp2_tp2_tied_clip", pp=2, tp=2, tied=True, clip=True),
]
REFERENCES = sorted({case.reference for case in CASES}, key=lambda c: c.name)


def _train(case: Case, initial: Optional[Dict[str, torch.Tensor]]) -> dict:
    """Train ``case`` on this rank for STEPS steps; record what the test compares.

    Returns ``initial`` (full weights before training, reference only) and, per step,
    ``losses`` (this data-parallel rank's per-micro-batch losses, on the loss rank),
    ``grads`` (before clipping) and ``weights`` (full-named, this rank's chunks) and the
    optimizer's ``grad_norms`` (None without clipping).
    """
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_with_interleaving,
        forward_backward_pipelining_without_interleaving,
    )

    from megatron_bitpipe.benchmarking import megatron_baseline as baseline
    from megatron_bitpipe.execution.groups import ParallelGrid
    from megatron_bitpipe.model.build import init_megatron_state
    from megatron_bitpipe.testing.weights import chunk_layers_of, collect_full, load_full, looped_chunk_layers

    grid = ParallelGrid(tp=case.tp, dp=case.dp, pp=case.pp)
    pg = baseline.build_looped_process_groups(grid)
    _, dp_rank, _ = grid.coords(torch.distributed.get_rank())
    init_megatron_state(pg, SEED)
    config = model_config(
        tensor_model_parallel_size=case.tp,
        pipeline_model_parallel_size=case.pp,
        virtual_pipeline_model_parallel_size=case.vp,
        batch_p2p_comm=case.batch_p2p,
        overlap_p2p_comm=case.overlap_p2p,
        deallocate_pipeline_outputs=case.overlap_p2p,
    )
    chunks = baseline.build_looped_chunks(
        config, pg, vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=case.tied
    )
    for v, chunk in enumerate(chunks):
        layout = looped_chunk_layers(config, pg.pp.rank(), v if case.vp else None, tied=case.tied)
        assert chunk_layers_of(chunk) == layout, (chunk_layers_of(chunk), layout)
        if initial is not None:
            load_full(chunk, initial, tp_group=pg.tp)
    record: dict = {"dp_rank": dp_rank, "losses": [], "grads": [], "weights": [], "grad_norms": []}
    if initial is None:
        record["initial"] = merge_full(collect_full(c, tp_group=pg.tp) for c in chunks)
    model = baseline.wrap_looped_ddp(chunks, config, pg)
    clip_grad = CLIP_GRAD if case.clip else 0.0
    optimizer = baseline.build_baseline_optimizer(model, pg, lr=LR, adam_eps=ADAM_EPS, clip_grad=clip_grad)

    per_dp = NUM_MICROBATCHES // case.dp
    for step in range(STEPS):
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        batches = baseline.synthetic_microbatches(SEED + step, NUM_MICROBATCHES, MICRO_BATCH, SEQ, VOCAB)
        mine = batches[dp_rank * per_dp : (dp_rank + 1) * per_dp]
        if case.pp == 1:
            losses = _plain_forward_backward(model[0], mine)
            finalize_model_grads(model, pg_collection=pg)
        else:
            schedule = (
                forward_backward_pipelining_with_interleaving
                if case.vp
                else forward_backward_pipelining_without_interleaving
            )
            reports = schedule(
                forward_step_func=baseline.mean_loss_forward_step,
                data_iterator=[iter(mine) for _ in model],
                model=model,
                num_microbatches=per_dp,
                seq_length=SEQ,
                micro_batch_size=MICRO_BATCH,
                p2p_communicator=P2PCommunicator(pg.pp, config),
                pg_collection=pg,
            )
            losses = [r["lm loss"].item() for r in reports]
        record["losses"].append(losses)
        grads = (collect_full(c, lambda p: p.main_grad, tp_group=pg.tp) for c in model)
        record["grads"].append(merge_full(grads))
        success, grad_norm, _ = optimizer.step()
        assert success
        record["grad_norms"].append(grad_norm)
        record["weights"].append(merge_full(collect_full(c, tp_group=pg.tp) for c in model))
    return record


def _plain_forward_backward(model, batches) -> List[float]:
    """Single-process reference: mean token loss per micro-batch, gradients of their mean."""
    losses = []
    for tokens, labels in batches:
        position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
        loss = model(tokens, position_ids, None, labels=labels).float().mean()
        (loss / len(batches)).backward()
        losses.append(loss.item())
    return losses


def _run_cases(cases: List[Case], initial: Dict[Case, Dict[str, torch.Tensor]]) -> List[dict]:
    """Launched function: every case in turn on the same ranks (fresh groups and models each).

    A case starts from ``initial[case.reference]`` if given, else from its own initialisation.
    """
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    enable_cpu_megatron()
    return [_train(case, initial.get(case.reference)) for case in cases]


@pytest.fixture(scope="module")
def reference() -> Dict[Case, dict]:
    """Single-rank training records, one per reference case, from one launch."""
    records = launch(_run_cases, 1, REFERENCES, {}, timeout=120)[0]
    return dict(zip(REFERENCES, records))


@pytest.fixture(scope="module")
def distributed(reference) -> Dict[str, List[dict]]:
    """Per-rank records of every case, from one 4-rank launch."""
    initial = {case: record["initial"] for case, record in reference.items()}
    per_rank = launch(_run_cases, 4, CASES, initial, timeout=240)
    return {case.name: [rank_records[i] for rank_records in per_rank] for i, case in enumerate(CASES)}


def _merged(records: List[dict], key: str, step: int) -> Dict[str, torch.Tensor]:
    return merge_full(r[key][step] for r in records)


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_schedule_matches_single_process(case: Case, reference, distributed):
    tolerance = (0.0, 0.0) if case.exact else (RTOL, ATOL)
    close = functools.partial(torch.testing.assert_close, rtol=tolerance[0], atol=tolerance[1])
    ref = reference[case.reference]
    records = distributed[case.name]
    for step in range(STEPS):
        losses = []
        for dp_rank in range(case.dp):
            # Every tensor-parallel rank of the last stage reports the same losses.
            reporting = [r["losses"][step] for r in records if r["dp_rank"] == dp_rank and r["losses"][step]]
            losses += reporting[0]
        close(torch.tensor(losses), torch.tensor(ref["losses"][step]), msg=f"losses, step {step}")
        norms = {r["grad_norms"][step] for r in records}
        assert len(norms) == 1, f"ranks disagree on the grad norm: {norms}"
        if case.clip:
            close(norms.pop(), ref["grad_norms"][step], msg=f"grad norm, step {step}")
        for key in ("grads", "weights"):
            actual = _merged(records, key, step)
            expected = ref[key][step]
            assert actual.keys() == expected.keys()
            for name in expected:
                close(actual[name], expected[name], msg=lambda m: f"{key}[{name}] step {step}: {m}")


def _probe_compat() -> dict:
    """Launched function: what the compatibility layer does to torch and megatron's RNG."""
    import megatron.core.tensor_parallel.random as mcore_random
    from torch.overrides import _get_current_function_mode_stack

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron, is_cpu_megatron_enabled

    before = is_cpu_megatron_enabled()
    enable_cpu_megatron()
    enable_cpu_megatron()
    x = torch.zeros(2, device="cuda")

    def draws():
        seed = mcore_random.model_parallel_cuda_manual_seed
        seed(7, tp_rank=1, ep_rank=0, etp_rank=0, force_reset_rng=True)
        with mcore_random.get_cuda_rng_tracker().fork():
            forked = torch.rand(3)
        return forked, torch.rand(3)

    (forked, default), (forked_again, default_again) = draws(), draws()
    torch.manual_seed(7)
    return {
        "enabled": (before, is_cpu_megatron_enabled()),
        "modes": len(_get_current_function_mode_stack()),
        "devices": {
            str(t.device)
            for t in (
                x,
                torch.empty(1, device=torch.cuda.current_device()),
                torch.tensor([1.0], device=torch.device("cuda", 0)),
                x.to("cuda:0"),
                x.new_zeros(1, device="cuda"),
            )
        },
        "cuda_is_self": x.cuda() is x,
        "type": (x.type(), x.int().type(), x.type(torch.float64).dtype),
        "synchronize": torch.cuda.synchronize(),
        "rng_reproducible": torch.equal(forked, forked_again) and torch.equal(default, default_again),
        "fork_is_own_stream": not torch.equal(forked, default),
        "default_stream_is_seed": torch.equal(default, torch.rand(3)),
    }


@pytest.mark.multirank
def test_compat_layer_redirects_cuda_to_cpu():
    facts = launch(_probe_compat, 1, timeout=60)[0]
    assert facts["enabled"] == (False, True)
    assert facts["modes"] == 1, "enable_cpu_megatron() must be idempotent"
    assert facts["devices"] == {"cpu"}
    assert facts["cuda_is_self"]
    assert facts["type"] == ("torch.cuda.FloatTensor", "torch.cuda.IntTensor", torch.float64)
    assert facts["synchronize"] is None
    assert facts["rng_reproducible"] and facts["fork_is_own_stream"] and facts["default_stream_is_seed"]


_P2P_SHAPE = (16, 1, 32)


def _overlapped_sends_after_freeing(trials: int) -> list:
    """Launched on 2 ranks: rank 0 sends ``trials`` outputs the way megatron's interleaved
    schedule does with ``overlap_p2p_comm`` (asynchronous send, then
    ``deallocate_output_tensor`` at once, then other allocations); rank 1 posts its receive only
    after that. Returns what rank 1 received (rank 0: [])."""
    import torch.distributed as dist
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    enable_cpu_megatron()
    config = ModelParallelConfig(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32, batch_p2p_comm=False)
    communicator = P2PCommunicator(dist.group.WORLD, config)
    received = []
    for trial in range(trials):
        if dist.get_rank() == 0:
            output = torch.full(_P2P_SHAPE, float(trial + 1), requires_grad=True) * 1.0
            _, handles = communicator.send_forward_recv_forward(
                output, recv_prev=False, tensor_shape=_P2P_SHAPE, overlap_p2p_comm=True
            )
            deallocate_output_tensor(output, deallocate_pipeline_outputs=True)
            reused = [torch.full(_P2P_SHAPE, float("nan")) for _ in range(8)]  # the freed memory, reused
            dist.barrier()
            for handle in handles.values():
                handle.wait()
            del reused
        else:
            dist.barrier()
            received.append(communicator.recv_forward(_P2P_SHAPE, is_first_stage=False).detach().clone())
    return received


@pytest.mark.multirank
def test_overlapped_p2p_sends_the_output_it_was_given_after_the_schedule_freed_it():
    """gloo reads a send's bytes when the receiver is ready, after ``isend`` returned: without
    the layer's private send copies the receiver gets the freed (here: NaN-filled) memory."""
    trials = 10
    received = launch(_overlapped_sends_after_freeing, 2, trials, timeout=120)[1]
    wrong = [trial for trial, tensor in enumerate(received) if not torch.equal(tensor, torch.full(_P2P_SHAPE, trial + 1.0))]
    assert len(received) == trials and wrong == [], f"trials {wrong} received other bytes than were sent"


def test_only_tests_import_the_testing_package():
    """``megatron_bitpipe.testing`` is test-only: nothing in the package outside it, and no
    script, imports it; the library proper (schedules, runtime, optimus, training, Megatron-LM
    integration) never imports the CPU layer, which entry points opt into."""
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[2]
    package = root / "megatron_bitpipe"
    sources = [p for p in package.rglob("*.py") if "testing" not in p.relative_to(package).parts]
    sources += list((root / "scripts").rglob("*.py"))
    importers = [str(p.relative_to(root)) for p in sources if re.search(r"megatron_bitpipe\.testing|from \.+testing", p.read_text())]
    assert importers == []
    library = [package / name for name in ("schedules", "runtime", "optimus", "training", "megatron_lm")]
    cpu_users = [
        str(p.relative_to(root))
        for folder in library
        for p in folder.rglob("*.py")
        if re.search(r"megatron_bitpipe\.cpu\b|from \.\.cpu\b", p.read_text())
    ]
    assert cpu_users == []
