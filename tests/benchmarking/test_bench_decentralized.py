"""scripts/bench_decentralized.py: its flags and arithmetic (pure Python; the benchmark itself
is run by hand, docs/decentralized.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import bench_decentralized as bench  # noqa: E402


def test_every_method_parses_on_four_replicas(tmp_path):
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.gpt import GPTTask

    prefix = tmp_path / "docs_text_document"
    for suffix in (".bin", ".idx"):
        Path(f"{prefix}{suffix}").write_bytes(b"")
    settings = bench.Settings()
    for batch, size, lr in settings.batches:
        for method in bench.METHODS:
            args = parse_args(GPTTask(), bench.pretrain_flags(settings, str(prefix), 1, batch, method), world_size=bench.REPLICAS)
            assert (args.global_batch_size, args.lr, args.optimizer) == (size, lr, "sgd")
            assert args.data_parallel_mode == method.split("-")[0] and args.eval_iters * size == settings.validation_samples


def _record(iteration, sent=None, validation=None, distance=None):
    record = {"iteration": iteration, "lm_loss": 5.0 - iteration, "comm_bytes_per_replica": sent, "consensus_distance": distance}
    if validation is not None:
        record["validation_lm_loss"] = validation
    return record


STARTUP = {"ranks": [{"dp_rank": d, "parameters": 1000} for d in range(4)]}


def test_bytes_accumulate_per_replica():
    gossip = bench.summarize("decentlam-ring", STARTUP, [_record(1, 8000.0), _record(2, 8000.0, 3.0, 0.5)])
    assert gossip["curve"] == [(2, 16000.0, 3.0)] and gossip["final_consensus_distance"] == 0.5
    # synchronous: a ring all-reduce of the fp32 gradients, 2 (n - 1) / n of 4000 bytes per iteration
    sync = bench.summarize("sync", STARTUP, [_record(1), _record(2, validation=3.1)])
    assert sync["curve"] == [(2, 12000.0, 3.1)] and sync["megabytes_per_replica"] == pytest.approx(0.012)
    assert sync["final_consensus_distance"] == 0.0


def test_table_compares_with_sync_of_the_same_seed():
    rows = [
        dict(batch="small", global_batch_size=16, seed=s, method=m, final_validation_loss=loss, megabytes_per_replica=1.0, final_consensus_distance=0.0)
        for s, m, loss in ((1, "sync", 3.0), (2, "sync", 3.2), (1, "lsgd", 3.1), (2, "lsgd", 3.25))
    ]
    table = bench.markdown_table(rows)
    assert "| small (16) | lsgd | 3.175 (3.100–3.250) | 0.0750 (0.0500–0.1000) |" in table
