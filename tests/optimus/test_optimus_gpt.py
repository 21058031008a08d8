"""GPTModel in Optimus 2D mode (q=2) trains exactly like its single-process twin.

Every rank builds the serial twin (same seed) in-process and trains it on the whole global
batch; after every step it checks its own 2-D blocks against the twin: per-micro-batch
losses, gradients (megatron DDP's ``main_grad``), the grad norm megatron's optimizer reports
(with clipping that binds) and the weights after Adam. Cases: q=2 alone (tied and untied
embeddings), q=2 × data parallel 2, q=2 × pipeline 2 with megatron-core's 1F1B schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_bitpipe.cpu.launcher import launch
from .optimus_support import check

pytestmark = pytest.mark.timeout(240)

SEED, STEPS = 1234, 3
LAYERS, HIDDEN, HEADS, VOCAB, SEQ = 2, 16, 4, 32, 8
MICRO_BATCH, NUM_MICROBATCHES = 4, 4
# Adam's eps well above the ~1e-9 rounding noise of gradients that are zero in exact
# arithmetic (key biases), so that noise does not become an lr-sized update.
LR, ADAM_EPS, CLIP_GRAD = 1e-2, 1e-4, 0.2


# RMSNorm, SwiGLU (fc1 in megatron's stride-2 layout), no biases, grouped-query attention
LLAMA_STYLE = dict(
    normalization="RMSNorm",
    gated_linear_unit=True,
    activation_func=F.silu,
    add_bias_linear=False,
    num_query_groups=2,
)


@dataclass(frozen=True)
class Case:
    name: str
    dp: int = 1
    pp: int = 1
    tied: bool = False
    position_embedding_type: str = "learned_absolute"
    llama_style: bool = False

    @property
    def world(self) -> int:
        return 4 * self.dp * self.pp


CASES = [
    Case("q2"),
    Case("q2_tied", tied=True),
    Case("q2_rope_llama_style", position_embedding_type="rope", llama_style=True),
    Case("q2_dp2", dp=2),
    Case("q2_pp2_tied", pp=2, tied=True),
]


def _solo_process_groups():
    """Process groups of a single-process model: this rank alone in every one."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    solo, _ = dist.new_subgroups_by_enumeration([[r] for r in range(dist.get_world_size())])
    names = "tp pp dp dp_cp mp pos_embd cp tp_cp ep expt_tp tp_ep expt_dp tp_ep_pp".split()
    return ProcessGroupCollection(embd=None, **{name: solo for name in names})


def _config(case: Case, tp: int, pp: int):
    from megatron_bitpipe.benchmarking.megatron_baseline import tiny_gpt_config

    return tiny_gpt_config(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        **(LLAMA_STYLE if case.llama_style else {}),
    )


def _model_losses(model, tokens, position_ids, labels) -> torch.Tensor:
    return model(tokens, position_ids, None, labels=labels)


def _fp32_reference_losses(model, tokens, position_ids, labels) -> torch.Tensor:
    """Per-token losses from the logits with torch's cross entropy. (megatron-core's fused
    'native' cross entropy rounds the logits' gradient to bf16, and its unfused one reads
    the global TP group, so the reference computes the loss itself.)"""
    logits = model(tokens, position_ids, None)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)


def _forward_backward(model, batches, per_token_losses=_model_losses) -> List[float]:
    """No pipelining: mean token loss per micro-batch, gradients of their mean."""
    losses = []
    for tokens, labels in batches:
        position_ids = torch.arange(tokens.shape[1]).expand_as(tokens)
        loss = per_token_losses(model, tokens, position_ids, labels).float().mean()
        (loss / len(batches)).backward()
        losses.append(loss.item())
    return losses


class _SerialTwin:
    """The single-process model, trained on the whole global batch on this rank."""

    def __init__(self, case: Case):
        from megatron_bitpipe.benchmarking import megatron_baseline as baseline
        from megatron_bitpipe.model.build import init_megatron_state

        self.pg = _solo_process_groups()
        init_megatron_state(self.pg, SEED)
        self.config = _config(case, tp=1, pp=1)
        model = baseline.build_megatron_gpt_model(
            self.config,
            self.pg,
            vocab_size=VOCAB,
            max_sequence_length=SEQ,
            share_embeddings_and_output_weights=case.tied,
            position_embedding_type=case.position_embedding_type,
        )
        self.initial = {name: p.detach().clone() for name, p in model.named_parameters()}
        self.ddp = baseline.wrap_looped_ddp([model], self.config, self.pg)
        self.optimizer = baseline.build_baseline_optimizer(
            self.ddp, self.pg, lr=LR, adam_eps=ADAM_EPS, clip_grad=CLIP_GRAD
        )

    def step(self, batches) -> Dict[str, object]:
        from megatron.core.distributed import finalize_model_grads

        self.ddp[0].zero_grad_buffer()
        self.optimizer.zero_grad()
        losses = _forward_backward(self.ddp[0], batches, _fp32_reference_losses)
        finalize_model_grads(self.ddp, pg_collection=self.pg)
        grads = {n: p.main_grad.clone() for n, p in self.ddp[0].module.named_parameters()}
        success, grad_norm, _ = self.optimizer.step()
        assert success
        weights = {n: p.detach().clone() for n, p in self.ddp[0].module.named_parameters()}
        return {"losses": losses, "grads": grads, "grad_norm": grad_norm, "weights": weights}


def _train_and_compare(case: Case) -> None:
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.pipeline_parallel.schedules import (
        forward_backward_pipelining_without_interleaving,
    )

    from megatron_bitpipe.optimus.gpt_model import OptimusGPTModel, optimus_p2p_tensor_shapes
    from megatron_bitpipe.optimus.layout import load_serial_state_dict, shard_serial_tensor
    from megatron_bitpipe.optimus.mesh import build_optimus_mesh
    from megatron_bitpipe.benchmarking import megatron_baseline as baseline
    from megatron_bitpipe.execution.groups import ParallelGrid
    from megatron_bitpipe.model.build import init_megatron_state
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.testing.weights import chunk_layers_of, to_global_name

    enable_cpu_megatron()
    twin = _SerialTwin(case)

    grid = ParallelGrid(tp=4, dp=case.dp, pp=case.pp)
    pg = baseline.build_looped_process_groups(grid)
    mesh = build_optimus_mesh(pg.tp)
    _, dp_rank, _ = grid.coords(dist.get_rank())
    init_megatron_state(pg, SEED)
    config = _config(case, tp=4, pp=case.pp)
    pp_rank, last = pg.pp.rank(), pg.pp.size() - 1
    model = OptimusGPTModel(
        config,
        VOCAB,
        SEQ,
        mesh=mesh,
        pg_collection=pg,
        pre_process=pp_rank == 0,
        post_process=pp_rank == last,
        share_embeddings_and_output_weights=case.tied,
        position_embedding_type=case.position_embedding_type,
    )
    chunk = chunk_layers_of(model)
    serial_name = lambda name: to_global_name(name, chunk)  # noqa: E731
    params = dict(model.named_parameters())

    def serial_block(serial: Dict[str, torch.Tensor], name: str) -> torch.Tensor:
        return shard_serial_tensor(serial[serial_name(name)], params[name].optimus_layout, mesh)

    if case.pp == 1:  # (megatron's own cpu initialisation depends on the pipeline split)
        # Same seed, cpu initialisation: the 2-D model starts from the twin's weights exactly.
        for name, param in params.items():
            check(f"initial {name}", param.detach(), serial_block(twin.initial, name))
    load_serial_state_dict(model, twin.initial, mesh, serial_name)

    ddp = baseline.wrap_looped_ddp([model], config, pg)
    optimizer = baseline.build_baseline_optimizer(ddp, pg, lr=LR, adam_eps=ADAM_EPS, clip_grad=CLIP_GRAD)
    per_dp = NUM_MICROBATCHES // case.dp
    for step in range(STEPS):
        batches = baseline.synthetic_microbatches(SEED + step, NUM_MICROBATCHES, MICRO_BATCH, SEQ, VOCAB)
        expected = twin.step(batches)
        mine = batches[dp_rank * per_dp : (dp_rank + 1) * per_dp]
        ddp[0].zero_grad_buffer()
        optimizer.zero_grad()
        if case.pp == 1:
            losses = _forward_backward(ddp[0], mine)
            finalize_model_grads(ddp, pg_collection=pg)
        else:
            reports = forward_backward_pipelining_without_interleaving(
                forward_step_func=baseline.mean_loss_forward_step,
                data_iterator=iter(mine),
                model=ddp,
                num_microbatches=per_dp,
                seq_length=SEQ,
                micro_batch_size=MICRO_BATCH,
                adjust_tensor_shapes_fn=optimus_p2p_tensor_shapes(mesh),
                p2p_communicator=P2PCommunicator(pg.pp, config),
                pg_collection=pg,
            )
            losses = [r["lm loss"].item() for r in reports]
        if losses:
            check(
                f"losses step {step}",
                torch.tensor(losses),
                torch.tensor(expected["losses"][dp_rank * per_dp :][:per_dp]),
            )
        for name, param in params.items():
            check(
                f"grad {name} step {step}", param.main_grad, serial_block(expected["grads"], name)
            )
        success, grad_norm, _ = optimizer.step()
        assert success
        check(
            f"grad norm step {step}", torch.tensor(grad_norm), torch.tensor(expected["grad_norm"])
        )
        assert (
            grad_norm > CLIP_GRAD
        ), f"clipping must bind for the grad-norm check to matter: {grad_norm}"
        for name, param in params.items():
            check(
                f"weight {name} step {step}",
                param.detach(),
                serial_block(expected["weights"], name),
            )


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_optimus_gpt_trains_like_single_process(case: Case):
    launch(_train_and_compare, case.world, case, timeout=200)


def _dropout_patterns():
    """Which elements the embedding dropout and the residual dropout zero on this rank."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_bitpipe.optimus.attention import get_optimus_bias_dropout_add
    from megatron_bitpipe.optimus.embedding import OptimusEmbedding
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.benchmarking.megatron_baseline import tiny_gpt_config
    from .optimus_support import world_mesh

    enable_cpu_megatron()
    mesh = world_mesh()
    torch.manual_seed(SEED)  # the default stream: identical on every rank
    model_parallel_cuda_manual_seed(
        SEED, tp_rank=mesh.tp_rank, ep_rank=0, etp_rank=0, force_reset_rng=True
    )
    config = tiny_gpt_config(
        num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, hidden_dropout=0.5
    )
    embedding = OptimusEmbedding(config, VOCAB, SEQ, "none", mesh, initialize=False).train()
    with torch.no_grad():
        embedding.word_embeddings.weight.fill_(1.0)
    tokens = torch.zeros(MICRO_BATCH, SEQ, dtype=torch.long)
    embedded = embedding(tokens, None)
    residual = torch.ones_like(embedded)
    added = get_optimus_bias_dropout_add(True, False)(
        (torch.ones_like(embedded), None), residual, 0.5
    )
    return (embedded == 0).flatten().tolist(), (added == 1).flatten().tolist()


@pytest.mark.multirank
def test_dropout_masks_differ_per_mesh_position():
    per_rank = launch(_dropout_patterns, 4)
    for which in range(2):
        patterns = [tuple(rank[which]) for rank in per_rank]
        assert all(0 < sum(p) < len(p) for p in patterns)
        assert len(set(patterns)) == 4, "two mesh positions drew the same dropout mask"
