"""HFTA for BERT (``pretrain_bert.py --hfta-models``): a fused array of BERTs trains each model
exactly as its own run.

* Flags: a fused BERT array parses into its settings; tensor parallelism is refused naming the
  flag, before any process group exists (pure Python).
* Single process, fp32, B = 2 with two learning rates and two seeds, Adam with weight decay and
  active clipping (``--clip-grad 0.5``), tied embeddings, the binary head and token types, mock
  data with padding: model ``k``'s logged MLM and next-sentence losses, gradients (as clipped)
  and weights after each of 3 steps and its validation losses equal the unfused BERT run with
  ``--lr`` its rate starting from its seed's weights, on the same batches (rtol 1e-5).
* BitPipe over 4 pipeline ranks with ``--split-backward`` (the batched linears, heads included,
  defer their weight gradients to ``W``): losses, gradients and weights equal the
  single-process fused run.
* BitPipe over 2 pipeline ranks x DP 2 with ``--use-distributed-optimizer`` (each rank holds
  its shares of every model's Adam state): the same.
* Checkpoints (``torch_dist``): the array resumed from its iteration-2 checkpoint trains
  iteration 3 bit for bit as the uninterrupted run; model 1 extracted from the iteration-3
  checkpoint (``scripts/hfta_extract.py``'s function) and loaded by the training loop as an
  ordinary BERT (``--no-load-optim``) has the array's model-1 validation losses.
* Loss and logs: each model's rows of the fused output get the gradient of its own BERT loss
  (in-process); ``lm_losses`` / ``sop_losses`` (one per model), ``lm loss`` / ``sop loss``
  their means, ``best_model`` the model with the lowest training loss (lm + sop); with one
  loss the fields are GPT's.

One single-process launch (references, checkpoints) and one launch of 4 ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

import pytest
import torch

from megatron_bitpipe.megatron_args import BitPipeConfigError
from megatron_bitpipe.training.arguments import parse_args

from .hfta_bert_support import EXTRACTED, LRS, MODEL, SEEDS, hfta_flags, reference_records, train_records
from .hfta_support import merged_ranks

STEPS = 3
RTOL, ATOL = 1e-5, 1e-6
LAUNCH_TIMEOUT = 600
NAMES = ("lm loss", "sop loss")


@dataclass(frozen=True)
class HftaBertCase:
    name: str
    flags: tuple
    world_size: int = 4
    reference_key: str = "single"


SPLIT_PP4 = HftaBertCase("bitpipe_split_pp4", ("--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "4", "--split-backward"))
DISTOPT_PP2_DP2 = HftaBertCase(
    "bitpipe_pp2_dp2_distopt", ("--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2", "--use-distributed-optimizer")
)
CASES = [SPLIT_PP4, DISTOPT_PP2_DP2]


def run_cases(cases: List[HftaBertCase]) -> dict:
    """Each case's records, with ``deferred``: how many batched GEMMs ran with their weight
    gradient deferred to ``W``, by module kind (``heads``: outside the encoder layers)."""
    from megatron_bitpipe.hfta import bert, layers

    deferred, apply = {"layers": 0, "heads": 0}, layers._DeferredWeightGradBmm.apply
    head_queues = set()

    def counted(input_, weight, holder, queue):
        deferred["heads" if id(queue) in head_queues else "layers"] += 1
        return apply(input_, weight, holder, queue)

    layers._DeferredWeightGradBmm.apply = counted
    original_build_heads = bert.HftaBertChunk._build_heads

    def build_heads(chunk):
        original_build_heads(chunk)
        head_queues.update(id(m.wgrad_queue) for m in (chunk.lm_head.dense, chunk.output_layer, chunk.pooler.dense, chunk.binary_head))

    bert.HftaBertChunk._build_heads = build_heads
    out = {}
    for case in cases:
        before = dict(deferred)
        out[case.name] = train_records([*MODEL, *hfta_flags(), *case.flags], STEPS, len(LRS))
        out[case.name]["deferred"] = {kind: deferred[kind] - before[kind] for kind in deferred}
    return out


def run_references(keys) -> dict:
    import tempfile

    with tempfile.TemporaryDirectory() as root:
        return {key: reference_records(root, STEPS) for key in keys}


def _close(actual: dict, expected: dict, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=RTOL, atol=ATOL, msg=lambda m: f"{what} {name}: {m}")


# ------------------------------------------------------------------------------ flags


def _parse(argv, world_size: int = 1):
    from megatron_bitpipe.training.bert_args import BertArguments  # BertTask's flags, without torch

    return parse_args(BertArguments(), [*MODEL, *argv], world_size=world_size, cuda_available=False)


def test_flags_parse_into_settings_and_refuse_tensor_parallelism():
    from megatron_bitpipe.hfta import hfta_settings

    settings = hfta_settings(_parse(hfta_flags()))
    assert (settings.num_models, settings.lrs, settings.seeds) == (len(LRS), LRS, SEEDS)
    with pytest.raises(BitPipeConfigError) as error:
        _parse([*hfta_flags(), "--tensor-model-parallel-size", "2"], world_size=2)
    message = str(error.value)
    assert "--hfta-models does not compose yet with: --tensor-model-parallel-size > 1 for BERT" in message
    assert message.count("--tensor-model-parallel-size") == 1
    assert hfta_settings(_parse(["--lr", "1e-3"])) is None


# ------------------------------------------------------------------------------ loss and reports


def test_loss_gives_each_model_its_own_bert_loss():
    """Model k's rows of the fused output get exactly the gradient of its own ``bert_loss``
    (after megatron's division by the masked-token count); reports: means and per model."""
    from megatron_bitpipe.training.bert import bert_loss, hfta_bert_loss

    b, s, num_models = 2, 5, 3
    generator = torch.Generator().manual_seed(0)
    per_token = torch.rand(num_models * b, s, generator=generator, requires_grad=True)
    logits = torch.randn(num_models * b, 2, generator=generator, requires_grad=True)
    loss_mask, is_random = torch.tensor([[1, 0, 1, 1, 0], [0, 1, 0, 0, 0]]), torch.tensor([1, 0])
    loss, count, reports = hfta_bert_loss(num_models, loss_mask, is_random, (per_token, logits))
    (loss / count).backward()
    sops = []
    for k in range(num_models):
        rows = slice(k * b, (k + 1) * b)
        own_tokens, own_logits = per_token.detach()[rows].requires_grad_(), logits.detach()[rows].requires_grad_()
        own, own_count, own_reports = bert_loss(loss_mask, is_random, (own_tokens, own_logits))
        (own / own_count).backward()
        torch.testing.assert_close(per_token.grad[rows], own_tokens.grad, rtol=0, atol=0)
        torch.testing.assert_close(logits.grad[rows], own_logits.grad, rtol=0, atol=0)
        for name in NAMES:
            assert torch.equal(reports[f"{name} {k}"], own_reports[name])
        sops.append(own_reports["sop loss"][0].item())
    assert count == own_count == 4
    assert reports["sop loss"].tolist() == pytest.approx([sum(sops) / num_models, 2.0])


def test_iteration_losses_of_one_loss_and_of_two():
    from megatron_bitpipe.hfta.reports import hfta_iteration_losses, hfta_loss_names

    assert hfta_loss_names(("lm loss",), 3) == ("lm loss", "lm loss 0", "lm loss 1", "lm loss 2")  # GPT's
    assert hfta_loss_names(NAMES, 2) == ("lm loss", "sop loss", "lm loss 0", "sop loss 0", "lm loss 1", "sop loss 1")
    losses = {"lm loss": 2.0, "lm loss 0": 2.5, "lm loss 1": 1.5, "lm loss 2": 2.0}
    assert hfta_iteration_losses(losses, ("lm loss",), 3) == ({"lm loss": 2.0, "best lm loss": 1.5}, {"lm_losses": [2.5, 1.5, 2.0], "best_model": 1})
    bert = {"lm loss": 2.0, "sop loss": 0.5, "lm loss 0": 1.9, "sop loss 0": 0.7, "lm loss 1": 2.1, "sop loss 1": 0.3}
    logged, extra = hfta_iteration_losses(bert, NAMES, 2)
    assert extra == {"lm_losses": [1.9, 2.1], "sop_losses": [0.7, 0.3], "best_model": 1}  # lowest lm + sop
    assert logged == {"lm loss": 2.0, "sop loss": 0.5, "best lm loss": 2.1, "best sop loss": 0.3}


# ------------------------------------------------------------------------------ equivalence


@pytest.mark.multirank
@pytest.mark.timeout(900)
@pytest.mark.parametrize("k", range(len(LRS)))
def test_model_k_equals_its_unfused_run(references, k):
    fused, unfused = references["single"]["fused"], references["single"]["unfused"][k]
    for step, (f, u) in enumerate(zip(fused["steps"], unfused["steps"])):
        assert f["extra"]["lm_losses"][k] == pytest.approx(u["losses"]["lm loss"], rel=RTOL), step
        assert f["extra"]["sop_losses"][k] == pytest.approx(u["losses"]["sop loss"], rel=RTOL), step
        assert u["grad_norm"] > 0.5, "clipping must be active"
        _close(f["models"][k]["grads"], u["models"][0]["grads"], f"step {step} grad")
        _close(f["models"][k]["weights"], u["models"][0]["weights"], f"step {step} weight")
    for name in NAMES:
        assert fused["validation"][f"{name} {k}"] == pytest.approx(unfused["validation"][name], rel=RTOL), name


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_logs_carry_every_models_losses(references):
    fused = references["single"]["fused"]
    for step in fused["steps"]:
        losses, extra = step["losses"], step["extra"]
        best = extra["best_model"]
        totals = [lm + sop for lm, sop in zip(extra["lm_losses"], extra["sop_losses"])]
        assert best == totals.index(min(totals))
        for name, key in zip(NAMES, ("lm_losses", "sop_losses")):
            assert len(extra[key]) == len(LRS)
            assert losses[name] == pytest.approx(sum(extra[key]) / len(LRS), rel=1e-6)  # the mean in fp32
            assert losses[f"best {name}"] == extra[key][best]
    assert len({tuple(step["extra"]["lm_losses"]) for step in fused["steps"]}) == STEPS  # the models train


def _equal_steps(ranks: List[dict], single: dict) -> None:
    """Every step's losses, gradients and weights of every model, then the validation losses."""
    for step in range(STEPS):
        for key in ("lm_losses", "sop_losses"):
            assert ranks[0]["steps"][step]["extra"][key] == pytest.approx(single["steps"][step]["extra"][key], rel=RTOL)
        for what in ("grads", "weights"):
            merged = merged_ranks(ranks, step, what)
            for k in range(len(LRS)):
                _close(merged[k], single["steps"][step]["models"][k][what], f"step {step} model {k} {what}")
    for name in NAMES:
        for k in range(len(LRS)):
            assert ranks[0]["validation"][f"{name} {k}"] == pytest.approx(single["validation"][f"{name} {k}"], rel=RTOL)


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_bitpipe_split_backward_pipeline_equals_single_process(references, launched):
    single, ranks = references["single"]["fused"], launched[SPLIT_PP4]
    assert all(rank["deferred"]["layers"] > 0 for rank in ranks), "the batched linears must defer their weight gradients"
    assert sum(rank["deferred"]["heads"] for rank in ranks) > 0, "the heads' batched linears must defer theirs"
    _equal_steps(ranks, single)


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_distributed_optimizer_pipeline_equals_single_process(references, launched):
    """BitPipe over 2 pipeline ranks x DP 2 with ``--use-distributed-optimizer``: each rank's
    gradient shares (clipped by each model's norm over the whole job) and the gathered
    weights equal the single process's."""
    ranks = launched[DISTOPT_PP2_DP2]
    assert all(rank["steps"][0]["models"][0]["grads"]["embedding.word_embeddings.weight"].isnan().any() for rank in ranks)
    _equal_steps(ranks, references["single"]["fused"])


@pytest.mark.multirank
@pytest.mark.timeout(900)
def test_checkpoint_resumes_exactly_and_model_extracts(references):
    record = references["single"]
    full, resumed = record["fused"]["steps"][STEPS - 1], record["resumed"]
    assert resumed["losses"] == full["losses"] and resumed["extra"] == full["extra"]
    assert resumed["grad_norm"] == full["grad_norm"]
    for k in range(len(LRS)):
        for name, tensor in full["models"][k]["weights"].items():
            assert torch.equal(resumed["models"][k]["weights"][name], tensor), (k, name)
    extracted, array = record["extracted"], record["fused"]["validation"]
    assert extracted["iteration"] == STEPS
    for name in NAMES:
        assert extracted["validation"][name] == pytest.approx(array[f"{name} {EXTRACTED}"], rel=1e-6), name
        assert array[f"{name} {EXTRACTED}"] != array[f"{name} {1 - EXTRACTED}"]
