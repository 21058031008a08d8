#!/usr/bin/env python
"""Core attention race: megatron-core's unfused ``DotProductAttention`` vs SDPA
(:class:`megatron_bitpipe.model.sdpa_attention.SdpaDotProductAttention`, ``--attention-backend sdpa``).

For each sequence length, both modules run forward + backward on the same causal GPT
attention inputs (``[s, b, heads, head_dim]``, megatron's layout, dropout 0), alternately, round
after round (``A B A B ...``), so that both see the same machine load; the table gives the
median time per forward + backward, the ratio unfused / SDPA, the attention TFLOP/s (causal
model FLOPs: 3 x 2 x b x heads x s^2 x head_dim, half of a dense attention's) and, on a GPU,
the peak memory of each. The outputs and input gradients of the two are compared once
(max abs difference) so that a race of two different computations cannot pass unnoticed.

``--gpt`` adds a small GPT training iteration race: ``scripts/pretrain_gpt.py`` with
``--attention-backend local`` and ``sdpa``, alternately (``--gpt-rounds`` runs of each), median
``elapsed_ms`` of the iterations after the first from ``--log-json``.

Defaults: on ``--device cuda`` bf16, s = 2048 and 4096, b 2, 16 heads of 128 (the attention
of the 8-layer h2048 GPT, ~0.5B parameters, of ``scripts/gpu_check.py``'s ``gpt-0.5b-bf16``);
it finishes in well under a minute. On ``--device cpu`` fp32, s = 512 and 1024, b 1, 8 heads
of 64. ``--json PATH`` writes the results (and the load average on
the CPU) as one JSON object.

Usage::

    python scripts/bench_attention.py --device cpu --gpt
    python scripts/bench_attention.py --device cuda --json attention_h100.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

warnings.filterwarnings("ignore", message="Transformer Engine and Apex are not installed")

BACKENDS = ("unfused", "sdpa")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class _OneRank:
    """A tensor-parallel 'group' of this process alone (the modules only ask its size)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _setup(device: str) -> None:
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if device == "cpu":
        from megatron_bitpipe.cpu.compat import enable_cpu_megatron

        enable_cpu_megatron()
    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234, tp_rank=0, ep_rank=0, etp_rank=0)
    parallel_state._set_global_memory_buffer()


def _modules(args, dtype):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_bitpipe.model.sdpa_attention import SdpaDotProductAttention

    config = TransformerConfig(
        num_layers=1,
        hidden_size=args.heads * args.head_dim,
        num_attention_heads=args.heads,
        num_query_groups=args.query_groups or args.heads,
        kv_channels=args.head_dim,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        masked_softmax_fusion=False,  # as scripts/pretrain_gpt.py configures megatron-core
        use_cpu_initialization=True,
        cuda_graph_scope=[],  # megatron's default spelling "full" is deprecated
    )
    pgs = SimpleNamespace(tp=_OneRank())
    made = {}
    for name, cls in (("unfused", DotProductAttention), ("sdpa", SdpaDotProductAttention)):
        made[name] = cls(config, 1, AttnMaskType.causal, "self", pg_collection=pgs).to(args.device).train()
    return made


def _inputs(args, s: int, dtype):
    generator = torch.Generator(device="cpu").manual_seed(s)
    groups = args.query_groups or args.heads

    def tensor(heads):
        t = torch.randn(s, args.batch, heads, args.head_dim, generator=generator).to(args.device, dtype)
        return t.requires_grad_()

    return tensor(args.heads), tensor(groups), tensor(groups)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _step(module, q, k, v, grad):
    for t in (q, k, v):
        t.grad = None
    out = module(q, k, v, None)
    out.backward(grad)
    return out


def race_attention(args) -> list:
    dtype = DTYPES[args.dtype]
    modules = _modules(args, dtype)
    rows = []
    for s in args.seq_lengths:
        q, k, v = _inputs(args, s, dtype)
        grad = torch.randn(s, args.batch, args.heads * args.head_dim, generator=torch.Generator().manual_seed(7)).to(args.device, dtype)
        outputs = {}
        memory = {}
        for name, module in modules.items():  # warm-up, equality check, peak memory
            if args.device == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            for _ in range(args.warmup):
                out = _step(module, q, k, v, grad)
            _sync(args.device)
            if args.device == "cuda":
                memory[name] = (torch.cuda.max_memory_allocated() - base) / 2**20
            outputs[name] = [out.detach().float()] + [t.grad.detach().float() for t in (q, k, v)]
        diff = max((a - b).abs().max().item() for a, b in zip(outputs["unfused"], outputs["sdpa"]))
        times = {name: [] for name in modules}
        deadline = time.perf_counter() + args.max_seconds_per_length
        for _ in range(args.rounds):
            for name, module in modules.items():
                _sync(args.device)
                start = time.perf_counter()
                for _ in range(args.iters):
                    _step(module, q, k, v, grad)
                _sync(args.device)
                times[name].append((time.perf_counter() - start) / args.iters * 1e3)
            if time.perf_counter() > deadline:
                break
        flops = 3 * 2 * args.batch * args.heads * s * s * args.head_dim  # causal: half of 4 b n s^2 d per pass
        row = dict(seq_length=s, batch=args.batch, heads=args.heads, query_groups=args.query_groups or args.heads,
                   head_dim=args.head_dim, dtype=args.dtype, rounds=len(times["sdpa"]), max_abs_diff=diff)  # fmt: skip
        for name in modules:
            ms = statistics.median(times[name])
            row[f"{name}_ms"] = ms
            row[f"{name}_tflops"] = flops / (ms * 1e-3) / 1e12
            if name in memory:
                row[f"{name}_peak_mib"] = memory[name]
        row["speedup"] = row["unfused_ms"] / row["sdpa_ms"]
        rows.append(row)
        del q, k, v, grad, outputs
    return rows


def race_gpt(args) -> dict:
    """Median iteration time of scripts/pretrain_gpt.py with each backend, run alternately."""
    model = args.gpt_flags.split()
    if args.device == "cuda" and args.dtype != "fp32":
        model.append(f"--{args.dtype}")
    times = {"local": [], "sdpa": []}
    tflops = {"local": [], "sdpa": []}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.gpt_rounds):
            for backend in times:
                log = Path(tmp) / f"{backend}_{round_}.jsonl"
                command = [sys.executable, str(REPO / "scripts" / "pretrain_gpt.py"), *model, "--attention-backend", backend,
                           "--transformer-impl", "local", "--log-json", str(log)]  # fmt: skip
                done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, timeout=600)
                if done.returncode:
                    raise SystemExit(f"pretrain_gpt.py --attention-backend {backend} failed:\n{done.stderr[-3000:]}")
                iterations = [r for r in map(json.loads, log.read_text().splitlines()) if r["event"] == "iteration"]
                times[backend] += [r["elapsed_ms"] for r in iterations[1:]]
                tflops[backend] += [r["tflops_per_device"] for r in iterations[1:] if r.get("tflops_per_device")]
    result = {f"{b}_ms": statistics.median(t) for b, t in times.items()}
    result.update({f"{b}_tflops": statistics.median(t) if t else None for b, t in tflops.items()})
    result.update(speedup=result["local_ms"] / result["sdpa_ms"], flags=" ".join(model), rounds=args.gpt_rounds)
    return result


def _markdown(rows, gpt, load) -> str:
    gpu = any("sdpa_peak_mib" in r for r in rows)
    head = "| s | b | heads | d | dtype | unfused ms | SDPA ms | unfused / SDPA | SDPA TFLOP/s |"
    rule = "|---|---|---|---|---|---|---|---|---|"
    if gpu:
        head += " unfused MiB | SDPA MiB |"
        rule += "---|---|"
    lines = [head, rule]
    for r in rows:
        line = (f"| {r['seq_length']} | {r['batch']} | {r['heads']} | {r['head_dim']} | {r['dtype']} | {r['unfused_ms']:.2f} | "
                f"{r['sdpa_ms']:.2f} | {r['speedup']:.2f} | {r['sdpa_tflops']:.3g} |")  # fmt: skip
        if gpu:
            line += f" {r['unfused_peak_mib']:.0f} | {r['sdpa_peak_mib']:.0f} |"
        lines.append(line)
    if gpt:
        rate = f" ({gpt['local_tflops']:.0f} vs {gpt['sdpa_tflops']:.0f} TFLOP/s)" if gpt.get("sdpa_tflops") else ""
        lines += ["", f"GPT iteration ({gpt['flags']}): local {gpt['local_ms']:.1f} ms, sdpa {gpt['sdpa_ms']:.1f} ms, "
                      f"local / sdpa {gpt['speedup']:.2f}{rate}"]  # fmt: skip
    if load is not None:
        lines += ["", "load average (1, 5, 15 min) before / after: " + " / ".join(", ".join(f"{x:.2f}" for x in l) for l in load)]
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default=None, help="default bf16 on cuda, fp32 on cpu")
    parser.add_argument("--seq-lengths", type=int, nargs="+", default=None, help="default 2048 4096 (cuda), 512 1024 (cpu)")
    parser.add_argument("--batch", type=int, default=None, help="default 2 (cuda), 1 (cpu)")
    parser.add_argument("--heads", type=int, default=None, help="default 16 (cuda), 8 (cpu)")
    parser.add_argument("--head-dim", type=int, default=None, help="default 128 (cuda), 64 (cpu)")
    parser.add_argument("--query-groups", type=int, default=None, help="GQA: key/value heads (default: --heads)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=None, help="forward+backward per timed sample (default 10 cuda, 2 cpu)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating timed samples per backend")
    parser.add_argument("--max-seconds-per-length", type=float, default=20.0, help="stop the rounds of one length after this")
    parser.add_argument("--gpt", action="store_true", help="also race a GPT iteration of scripts/pretrain_gpt.py")
    parser.add_argument("--gpt-rounds", type=int, default=3)
    parser.add_argument(
        "--gpt-flags",
        default=None,
        help="pretrain_gpt.py model flags (default: 4 layers h 256, 8 heads, s 512, b 2, 4 iterations on cpu; "
        "8 layers h 2048, 16 heads, s 2048, b 2, global batch 16, vocab 50304 on cuda: ~0.5B parameters)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as one JSON object")
    args = parser.parse_args(argv)
    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU is available")
    args.dtype = args.dtype or ("bf16" if gpu else "fp32")
    if not gpu and args.dtype != "fp32":
        parser.error("--dtype bf16/fp16 needs --device cuda")
    args.seq_lengths = args.seq_lengths or ([2048, 4096] if gpu else [512, 1024])
    args.batch = args.batch or (2 if gpu else 1)
    args.heads = args.heads or (16 if gpu else 8)
    args.head_dim = args.head_dim or (128 if gpu else 64)
    args.iters = args.iters or (10 if gpu else 2)
    if args.query_groups and args.heads % args.query_groups:
        parser.error(f"--heads {args.heads} must be divisible by --query-groups {args.query_groups}")
    if args.gpt_flags is None:
        common = "--lr 1e-4 --lr-warmup-iters 1 --log-interval 1 --eval-iters 0 --seed 1234"
        size = ("--num-layers 8 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 --micro-batch-size 2 --global-batch-size 16 --vocab-size 50304 --train-iters 6"
                if gpu else "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 --micro-batch-size 2 --vocab-size 1024 --train-iters 4")  # fmt: skip
        args.gpt_flags = f"{size} {common}"
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    load = [os.getloadavg()] if hasattr(os, "getloadavg") else None
    _setup(args.device)
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"
    rows = race_attention(args)
    gpt = race_gpt(args) if args.gpt else None
    if load is not None:
        load.append(os.getloadavg())
    print(f"{device_name}, torch {torch.__version__}")
    print(_markdown(rows, gpt, load))
    if args.json:
        result = dict(device=device_name, torch=torch.__version__, attention=rows, gpt=gpt, load_average=load)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
