"""CRAIG coresets (megatron_bitpipe.training.coreset, scripts/select_coreset.py, --coreset).

* Lazy-greedy facility location makes exactly the brute-force greedy's choices and weights
  (an independent reference: argmax of F(S ∪ {j}) over j, lowest index on ties), on random
  proxies and on integer similarities full of ties; Σγ = shard size; fraction 1 keeps all.
* The proxy equals autograd's gradient of the sample's mean token loss w.r.t. a logit bias.
* The weighted loss equals a hand-computed weighted mean on a tiny batch; the coreset stream
  is the selected samples in training order, cycled, with weights γ·k/n.
* Bad input: one error each, exit 2, before any work (another dataset, split, seq length,
  seed, tokenizer, sample count; fraction outside (0, 1]; no training samples).
* Training (mock data; one launch of 2 ranks, BitPipe PP2, and one single-process launch):
  ``--coreset`` of the script's ``--fraction 1`` file (every sample, γ = 1) gives bit for bit
  the full-data losses in both
  layouts; a weighted coreset's first loss equals the weighted mean computed by hand from the
  initial model, and PP2 equals single-process training on it; the selection script writes
  craig (proxies after a 2-iteration warm-up) and random files of the expected sizes and
  weights, and a run trains on the craig one.
"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from typing import Dict, List, NamedTuple

import numpy as np
import pytest
import torch

from megatron_bitpipe.megatron_args import BitPipeConfigError
from megatron_bitpipe.training.arguments import parse_args
from megatron_bitpipe.training.coreset.facility import assign_weights, facility_location, select_shard, similarities
from megatron_bitpipe.training.coreset.identity import CoresetFile, DatasetIdentity, read_coreset, write_coreset
from megatron_bitpipe.training.coreset.proxies import logit_gradient_proxies
from megatron_bitpipe.training.coreset.training import CoresetDataset, weighted_gpt_loss
from megatron_bitpipe.training.gpt_args import GPTArguments

# -- facility location against brute force ---------------------------------------------------


def brute_force(sim: np.ndarray, k: int):
    """Plain greedy on F(S) = Σ_i max_{j∈S} s_ij (lowest index on ties), and γ by a loop."""
    chosen: List[int] = []
    for _ in range(k):
        values = [
            -np.inf if j in chosen else sim[:, chosen + [j]].max(axis=1).sum()
            for j in range(sim.shape[0])
        ]
        chosen.append(int(np.argmax(values)))
    gamma = {j: 0 for j in chosen}
    for i in range(sim.shape[0]):
        best = i if i in gamma else min(chosen, key=lambda j: (-sim[i, j], j))
        gamma[best] += 1
    selected = sorted(chosen)
    return chosen, selected, [float(gamma[j]) for j in selected]


def _integer_similarities(rng, m: int) -> np.ndarray:
    upper = np.triu(rng.integers(0, 4, size=(m, m)), 1)
    sim = (upper + upper.T).astype(np.float64)
    np.fill_diagonal(sim, 4.0)
    return sim


@pytest.mark.parametrize("kind", ["random_proxies", "integer_ties"])
def test_lazy_greedy_equals_brute_force(kind):
    rng = np.random.default_rng(7)
    for m in (1, 5, 17, 30):
        sim = similarities(rng.normal(size=(m, 6))) if kind == "random_proxies" else _integer_similarities(rng, m)
        for k in sorted({min(2, m), 1, m // 3 or 1, m // 2 or 1, m}):
            chosen, selected, gamma = brute_force(sim, k)
            assert facility_location(sim, k) == chosen, (m, k)
            result = assign_weights(sim, facility_location(sim, k))
            assert result.indices.tolist() == selected
            assert result.gamma.tolist() == gamma
            assert result.gamma.sum() == m


def test_shard_selection_counts_and_duplicates():
    rng = np.random.default_rng(3)
    proxies = rng.normal(size=(20, 4))
    proxies[10:] = proxies[:10]  # every sample twice: a chosen one stands for its twin
    half = select_shard(proxies, 0.5)
    assert len(half.indices) == 10 and half.gamma.sum() == 20
    every = select_shard(proxies, 1.0)
    assert every.indices.tolist() == list(range(20)) and every.gamma.tolist() == [1.0] * 20
    assert len(select_shard(proxies, 0.01).indices) == 1  # at least one per shard


def test_proxy_is_the_gradient_of_the_mean_loss_wrt_a_logit_bias():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    mask = torch.tensor([[1.0, 1, 0, 1, 1], [0, 1, 1, 1, 0]])
    bias = torch.zeros(2, 1, 7, requires_grad=True)
    losses = torch.nn.functional.cross_entropy((logits + bias).transpose(1, 2), labels, reduction="none")
    ((losses * mask).sum(1) / mask.sum(1)).sum().backward()
    torch.testing.assert_close(logit_gradient_proxies(logits, labels, mask), bias.grad[:, 0], rtol=1e-6, atol=1e-7)


# -- weighted loss and stream ------------------------------------------------------------------


def test_weighted_loss_is_the_hand_computed_weighted_mean():
    losses = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    weights = torch.tensor([0.5, 2.0])
    loss, count, report = weighted_gpt_loss(mask, losses, sample_weights=weights)
    # 0.5 x (1 + 2) + 2 x (4 + 6) = 21.5 over the 4 loss tokens
    assert loss.item() == 21.5 and count.item() == 4
    assert report["lm loss"].tolist() == [21.5, 4.0]
    plain, _, _ = weighted_gpt_loss(mask, losses)
    assert plain.item() == 1 + 2 + 4 + 6
    same, _, _ = weighted_gpt_loss(mask, losses, sample_weights=torch.ones(2))
    assert same.item() == plain.item()


def _identity(n: int) -> DatasetIdentity:
    return DatasetIdentity("mock data, --vocab-size 64", "mock", 16, 1, "NullTokenizer vocab_size=64", n)


def test_coreset_stream_cycles_the_selected_samples_in_training_order(tmp_path):
    coreset = CoresetFile(np.array([1, 4, 6]), np.array([2.0, 3.0, 5.0]), _identity(10), {})
    path = str(tmp_path / "c.npz")
    write_coreset(path, coreset)
    stored = read_coreset(path)
    assert stored.identity == coreset.identity and stored.indices.tolist() == [1, 4, 6]
    stream = CoresetDataset([{"id": torch.tensor(i)} for i in range(10)], stored)
    assert [stream[p]["id"].item() for p in range(7)] == [1, 4, 6, 1, 4, 6, 1]
    assert [stream[p]["loss_weight"].item() for p in range(3)] == pytest.approx([0.6, 0.9, 1.5])  # γ x 3 / 10


def _datasets(args):
    """GPT's datasets of the checked flags ``args``, as the training loop builds them."""
    from megatron_bitpipe.run_config import RunConfig, TokenizerSettings
    from megatron_bitpipe.training.data import build_tokenizer
    from megatron_bitpipe.training.gpt import GPTTask

    task = GPTTask()
    tokenizer = build_tokenizer(TokenizerSettings.from_args(args))
    return task.build_datasets(RunConfig.from_args(args, tokenizer.vocab_size, task), tokenizer)


def test_a_run_on_a_coreset_says_so_at_start_up(tmp_path, capsys):
    """The training log names the coreset, how many samples of how many it trains on and
    that their losses are weighted; a run without one says nothing of coresets."""

    argv = [*MODEL, "--vocab-size", "64"]
    args = parse_args(GPTArguments(), argv, world_size=1, cuda_available=False)
    path = str(tmp_path / "c.npz")
    n = DatasetIdentity.from_args(args).train_samples
    write_coreset(path, CoresetFile(np.array([0, 5]), np.array([6.0, n - 6.0]), DatasetIdentity.from_args(args),
                                    {"method": "craig", "fraction": 0.25}))  # fmt: skip
    _datasets(args)
    assert "coreset" not in capsys.readouterr().out
    args = parse_args(GPTArguments(), [*argv, "--coreset", path], world_size=1, cuda_available=False)
    train, _, _ = _datasets(args)
    assert len(train) == 2
    assert capsys.readouterr().out == (
        f"coreset: training on 2 of {n} training samples (method craig, fraction 0.25) from {path}, cycled; "
        "each sample's loss weighted by the samples it stands for (mean weight 1)\n"
    )


# -- bad input ----------------------------------------------------------------------------------

MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3", "--eval-iters", "0"]


def _data(tmp_path) -> List[str]:
    prefix = tmp_path / "corpus_text_document"
    for suffix in (".bin", ".idx"):
        (prefix.parent / (prefix.name + suffix)).write_bytes(b"")
    return ["--data-path", str(prefix), "--split", "90,10,0", "--tokenizer-type", "ByteLevelTokenizer", "--vocab-size", "256"]


def _written(tmp_path, argv: List[str]) -> str:
    args = parse_args(GPTArguments(), argv, world_size=1, cuda_available=False)
    path = str(tmp_path / "made.npz")
    n = DatasetIdentity.from_args(args).train_samples
    write_coreset(path, CoresetFile(np.arange(n), np.ones(n), DatasetIdentity.from_args(args), {}))
    return path


@pytest.mark.parametrize(
    "change, message",
    [
        (["--seq-length", "32"], "made for --seq-length 16, this run has 32"),
        (["--seed", "5"], "made for --seed 1234, this run has 5"),
        (["--split", "80,20,0"], "made for --split 0.9,0.1,0, this run has 0.8,0.2,0"),
        (["--vocab-size", "300"], "made for --tokenizer-type/--vocab-size"),
        (["--train-iters", "4"], "made for --train-iters x --global-batch-size (training samples) 12, this run has 16"),
        (["--data-path", "OTHER"], "made for --data-path"),
    ],
)
def test_a_coreset_of_another_dataset_is_refused(tmp_path, change, message):
    base = [*MODEL, *_data(tmp_path)]
    path = _written(tmp_path, base)
    if change[0] == "--data-path":
        other = tmp_path / "other_text_document"
        for suffix in (".bin", ".idx"):
            (tmp_path / (other.name + suffix)).write_bytes(b"")
        change = ["--data-path", str(other)]
    with pytest.raises(BitPipeConfigError) as error:
        parse_args(GPTArguments(), [*base, *change, "--coreset", path], world_size=1, cuda_available=False)
    lines = [line for line in str(error.value).splitlines()[1:]]
    assert len(lines) == 1 and message in lines[0], str(error.value)
    parse_args(GPTArguments(), [*base, "--coreset", path], world_size=1, cuda_available=False)  # the same run: accepted


def _exit_and_stderr(main, argv) -> tuple:
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        status = main(argv)
    return status, stderr.getvalue()


def test_script_errors_exit_2_before_any_work(tmp_path):
    from megatron_bitpipe.training.coreset.select import main as select_main
    from megatron_bitpipe.training.script import run_script

    for fraction in ("0", "1.5", "-0.1"):
        status, err = _exit_and_stderr(select_main, [*MODEL, "--vocab-size", "64", "--fraction", fraction, "--output", str(tmp_path / "x.npz")])
        assert status == 2 and f"--fraction must be in (0, 1] (got {float(fraction)})" in err and err.count("error:") == 1
    assert not (tmp_path / "x.npz").exists()
    no_model = [*MODEL, "--vocab-size", "64", "--fraction", "0.5", "--output", str(tmp_path / "x.npz")]
    status, err = _exit_and_stderr(select_main, no_model)
    assert status == 2 and "--coreset-method craig needs a model for its proxies: --load DIR or --coreset-warmup-iters N > 0" in err
    status, err = _exit_and_stderr(select_main, [*no_model, "--load", str(tmp_path / "none")])
    assert status == 2 and f"--load {tmp_path / 'none'}: no checkpoint there" in err and not (tmp_path / "x.npz").exists()
    bad = [*MODEL, *_data(tmp_path), "--seed", "9", "--coreset", _written(tmp_path, [*MODEL, *_data(tmp_path)])]
    never = lambda: pytest.fail("the task must not be loaded")  # noqa: E731
    status, err = _exit_and_stderr(lambda argv: run_script(GPTArguments(), never, argv, prog="pretrain_gpt.py"), bad)
    assert status == 2 and "made for --seed 1234, this run has 9" in err


def test_a_dataset_without_training_samples_exits_2(tmp_path):
    from megatron_bitpipe.training.coreset.select import main as select_main
    from megatron_bitpipe.training.preprocess import tokenizer_settings, write_indexed_datasets

    documents = [{"text": f"document {i} " * 20} for i in range(10)]
    write_indexed_datasets(iter(documents), str(tmp_path / "tiny"), tokenizer_settings("ByteLevelTokenizer"), append_eod=True)
    data = ["--data-path", str(tmp_path / "tiny_text_document"), "--tokenizer-type", "ByteLevelTokenizer", "--vocab-size", "256"]
    argv = [*MODEL, *data, "--split", "0,100,0", "--eval-iters", "1", "--fraction", "0.5", "--coreset-method", "random", "--output", str(tmp_path / "x.npz")]
    status, err = _exit_and_stderr(select_main, argv)
    assert status == 2 and "--split 0,100,0: the training set gets no data" in err and err.count("error:") == 1
    assert not (tmp_path / "x.npz").exists()


# -- training on a coreset (multi-rank) ---------------------------------------------------------

TRAIN = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
         "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-2",
         "--vocab-size", "64", "--eval-iters", "0", "--log-interval", "1"]
PP2 = ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2"]
#: the hand-made weighted coreset of the 12 training samples
WEIGHTED = (np.array([0, 2, 3, 5, 7, 8, 11]), np.array([2.0, 1.0, 2.0, 1.0, 2.0, 3.0, 1.0]))


class Case(NamedTuple):
    name: str
    world_size: int
    reference_key: str
    layout: tuple


CASES = [Case("bitpipe_pp2", 2, "single", tuple(PP2))]


def _quiet(fn):
    with contextlib.redirect_stdout(io.StringIO()):
        return fn()


def _trainer(argv: List[str], world_size: int):
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.training.coreset.select import proxy_trainer
    from megatron_bitpipe.training.gpt import GPTTask

    args = parse_args(GPTTask(), argv, world_size=world_size, cuda_available=False)
    return args, _quiet(lambda: proxy_trainer(args, enable_cpu_megatron))


def _coreset_files(world_size: int, layout: List[str]) -> Dict[str, str]:
    """``all``: the selection script's file for ``--fraction 1`` (flags of one process: the
    file does not depend on the layout); ``weighted``: :data:`WEIGHTED` (a file per rank)."""
    import torch.distributed as dist

    from megatron_bitpipe.training.coreset.select import SelectionArguments, select

    directory = tempfile.mkdtemp(prefix=f"coreset_rank{dist.get_rank()}_")
    paths = {name: os.path.join(directory, f"{name}.npz") for name in ("all", "weighted")}
    selection = parse_args(SelectionArguments(), [*TRAIN, "--fraction", "1", "--output", paths["all"]], world_size=1, cuda_available=False)
    everything = select(selection, log=lambda line: None)
    assert everything.indices.tolist() == list(range(12)) and everything.gamma.tolist() == [1.0] * 12
    args = parse_args(GPTArguments(), [*TRAIN, *layout], world_size=world_size, cuda_available=False)
    write_coreset(paths["weighted"], CoresetFile(*WEIGHTED, DatasetIdentity.from_args(args), {}))
    return paths


def _losses(argv: List[str], world_size: int, hand: bool = False) -> dict:
    """The first 3 iterations' losses; with ``hand`` (one process, a weighted coreset) also
    the first one computed by hand from the initial model (:func:`_hand_weighted_first_loss`)."""
    _, trainer = _trainer(argv, world_size)
    first = _hand_weighted_first_loss(trainer) if hand else None
    return {"losses": [_quiet(trainer.train_step).losses["lm loss"] for _ in range(3)], "hand_first": first}


def _runs(world_size: int, layout: List[str]) -> Dict[str, dict]:
    paths = _coreset_files(world_size, layout)
    runs = {"full": _losses([*TRAIN, *layout], world_size)}
    for name, path in paths.items():
        runs[name] = _losses([*TRAIN, *layout, "--coreset", path], world_size, hand=name == "weighted" and world_size == 1)
    return runs


def run_cases(cases) -> dict:
    return {case.name: _runs(case.world_size, list(case.layout)) for case in cases}


def _hand_weighted_first_loss(trainer) -> float:
    """Σ w·m·l / Σ m over the first global batch of the :data:`WEIGHTED` stream, from the
    per-token losses of the initial model (one chunk) on the full training set's samples."""
    from megatron_bitpipe.training.data import collate

    data = trainer.train_data.dataset  # the full training set under the coreset's stream
    indices, gamma = WEIGHTED
    weights = gamma * len(indices) / 12
    batch = collate([data[int(indices[p])] for p in range(4)])
    with torch.no_grad():
        losses = trainer.model.chunks[0](batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    weighted = (losses.double() * batch["loss_mask"].double() * torch.tensor(weights[:4]).view(-1, 1)).sum()
    return (weighted / batch["loss_mask"].sum()).item()


def _selected_and_trained() -> dict:
    """The script's craig (2 warm-up iterations) and random files, and a run on the craig one."""
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.training.coreset.select import SelectionArguments, select

    directory = tempfile.mkdtemp(prefix="coreset_select_")
    result = {}
    for method in ("craig", "random"):
        path = os.path.join(directory, f"{method}.npz")
        argv = [*TRAIN, "--fraction", "0.5", "--coreset-method", method, "--coreset-warmup-iters", "2", "--coreset-shard-size", "5", "--output", path]
        args = parse_args(SelectionArguments(), argv, world_size=1, cuda_available=False)
        _quiet(lambda: select(args, enable_cpu_megatron, log=lambda line: None))
        coreset = read_coreset(path)
        result[method] = {"indices": coreset.indices.tolist(), "gamma": coreset.gamma.tolist(), "info": coreset.info}
    result["craig"]["losses"] = _losses([*TRAIN, "--coreset", os.path.join(directory, "craig.npz")], 1)["losses"]
    return result


def run_references(keys) -> dict:
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    enable_cpu_megatron()
    return {"single": _runs(1, []), "selected": _selected_and_trained()}


@pytest.mark.multirank
def test_coreset_training_single_process(references):
    runs = {name: run["losses"] for name, run in references["single"].items()}
    assert runs["all"] == runs["full"]  # every sample, γ = 1: bit for bit the full data's losses
    assert runs["weighted"][0] == pytest.approx(references["single"]["weighted"]["hand_first"], rel=1e-6)
    assert runs["weighted"] != runs["full"]


@pytest.mark.multirank
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_coreset_training_multi_rank(case, launched, references):
    for rank_runs in launched[case]:
        assert rank_runs["all"]["losses"] == rank_runs["full"]["losses"]  # bit for bit in this layout too
        for name in ("full", "weighted"):
            assert rank_runs[name]["losses"] == pytest.approx(references["single"][name]["losses"], rel=1e-5), name


@pytest.mark.multirank
def test_selection_script_files_train(references):
    selected = references["selected"]
    for method, record in selected.items():
        # shards of 5, 5, 2 samples keep 2 (round(2.5) = 2), 2 and 1
        assert len(record["indices"]) == 5 and sum(record["gamma"]) == pytest.approx(12), method
        assert record["indices"] == sorted(set(record["indices"]))
    assert all(np.isfinite(selected["craig"]["losses"]))
    assert selected["craig"]["info"]["warmup_iters"] == 2 and selected["craig"]["info"]["proxy"].startswith("output-layer")
    assert selected["random"]["gamma"] == [12 / 5] * 5
