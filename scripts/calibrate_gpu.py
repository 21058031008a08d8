#!/usr/bin/env python
"""Measure a cost file for the schedule simulator on a GPU.

Times one device share of a megatron-core GPT model — ``--num-layers`` transformer layers,
built and run **as a middle pipeline stage of training runs it** — for one micro-batch of
``[--seq-length, --micro-batch-size, --hidden-size]`` in fp32, ``--bf16`` or ``--fp16``
(a mixture-of-experts share with ``--num-experts``; one tensor-parallel rank's share with
``--tensor-model-parallel-size``, run on that many ranks, ``[s / tp, b, h]`` with
``--sequence-parallel``):

* the flags go through the pretrain scripts' own parser
  (:func:`megatron_bitpipe.training.arguments.parse_args`) and
  :func:`megatron_bitpipe.training.config.transformer_config`, so the config (``params_dtype``,
  ``pipeline_dtype``, ``bf16``/``fp16``, kernel fusions, ``deallocate_pipeline_outputs``,
  Transformer Engine or local layers) is the one training would use;
* the share is a ``GPTModel`` chunk without embedding and head (``pre_process`` and
  ``post_process`` false), made by the project's chunk factory
  (:func:`megatron_bitpipe.model.chunks.gpt_chunk_factory` through
  :func:`~megatron_bitpipe.model.chunks.build_chunks`), wrapped for mixed precision in
  :class:`~megatron_bitpipe.model.precision.ChunkFloat16Module` (megatron's
  ``Float16Module``: every parameter, layer norms included, in bf16/fp16) and in the project's
  megatron DDP (:func:`~megatron_bitpipe.execution.replicas.wrap_ddp`, fp32 gradient buffers);
* its input is the activation a middle stage receives: ``config.pipeline_dtype``; the
  forward and the backward are megatron's ``forward_step`` / ``backward_step`` as
  :class:`~megatron_bitpipe.execution.executor.PlanExecutor` calls them (output deallocated
  before the backward when the config says so), inside the chunk's ``no_sync``.

Measured (median of ``--iters`` after ``--warmup``; CUDA events on a GPU):

* ``F``, ``B``: forward and whole backward;
* with megatron-core's local layers (``--transformer-impl local``; the split backward
  defers only those), the split backward with the project's own deferral
  (:mod:`megatron_bitpipe.execution.weight_grad`, as the executor runs ``I`` and ``W``): the
  forward while the linears defer (``F_d``), ``I``, the backward with the weight gradients
  deferred, and ``W``, the chunk's
  :meth:`~megatron_bitpipe.execution.weight_grad.ChunkWeightGrad.backward_dw`.
  With Transformer Engine layers they are not measured (said in the output).
  ``scripts/bench_split.py`` counts what each of these runs (operators, FLOPs, bytes).

Communication:

* with two or more GPUs, NCCL between GPU 0 and GPU 1: the one-way time of a pipeline
  message (a 4-byte and an ``[s, b, h]`` message give latency and bandwidth) and the
  all-reduce of the device share's gradients over the pair (measured on at most 1 GiB),
  whose bus bandwidth is the file's ``sync_bandwidth``;
* with one GPU (or ``--device cpu``), from ``--p2p-latency-ms``, ``--p2p-bandwidth-gbs`` and
  ``--allreduce-bandwidth-gbs``.

Writes ``--output`` (default ``costs.json``): one JSON object whose keys are fields of
:class:`megatron_bitpipe.schedules.CostModel` (milliseconds, bytes, bytes/ms): ``t_forward``
(F), ``t_backward`` (B), ``t_weight`` (W), ``t_input`` (I) and ``t_forward_deferring`` (F_d)
when the split was measured,
``t_p2p``, ``p2p_bytes``, ``p2p_bandwidth``, ``t_sync``, ``grad_bytes``, ``sync_bandwidth``,
``data_parallel_size``, and ``t_a2a``, ``a2a_bandwidth``, ``t_cp`` and ``cp_bandwidth`` at 0
(set them to cost the all-to-alls of a mixture-of-experts model and the key/value exchange of
context parallelism). ``python -m megatron_bitpipe.schedules simulate --costs FILE``,
``--schedule-costs FILE`` of the pretrain scripts, ``scripts/bench_emulated.py --costs FILE``
and ``scripts/predict_throughput.py --costs FILE`` read it. What was measured and how is
printed; the last line is ``wrote FILE``.

The device share of the BitPipe paper's GPT (96 layers on 8 stages: 12 layers, h 3072, 32
heads, s 1024, micro-batch 1), as ``scripts/gpu_check.py`` runs it (one GPU, about 6 GiB
of weights and as much of fp32 gradient buffer in fp32)::

    python scripts/calibrate_gpu.py --num-layers 12 --hidden-size 3072 --num-attention-heads 32 \\
        --seq-length 1024 --micro-batch-size 1 --transformer-impl local --output gpt_share_fp32.json
    python scripts/calibrate_gpu.py --num-layers 12 --hidden-size 3072 --num-attention-heads 32 \\
        --seq-length 1024 --micro-batch-size 1 --transformer-impl local --bf16 --output gpt_share_bf16.json

Exit status: 0 after writing the file; 2 with one line on stderr for bad flags and, without
``--device cpu``, when no CUDA GPU is available (before anything is measured). ``--device
cpu`` measures on the CPU with gloo and megatron-bitpipe's CPU compatibility layer (for
tests and demos; the times are a CPU's, not a GPU's). ``--tensor-model-parallel-size 2``
runs under ``torchrun --nproc-per-node 2`` (rank 0 writes the file).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import asdict
from typing import Callable, Dict, List, Optional, Tuple

from megatron_bitpipe.schedules.costs import CostModel

NO_GPU = "needs a CUDA GPU (torch.cuda.is_available() is False); nothing was measured (--device cpu measures on the CPU)"
MAX_ALLREDUCE_BYTES = 1 << 30
#: the vocabulary of the measured chunk: it has no embedding or head, so any size does
VOCAB_SIZE = 128


def cost_model(
    t_forward: float,
    t_backward: float,
    comm: Dict[str, float],
    grad_bytes: float,
    t_weight: Optional[float] = None,
    t_input: Optional[float] = None,
    t_forward_deferring: Optional[float] = None,
) -> CostModel:
    """The CostModel of one measurement: compute (ms; ``t_weight``/``t_input``/``t_forward_deferring``
    the split backward's W, I and forward while deferring, None when not measured), ``comm`` =
    {latency_ms, bytes, bandwidth (bytes/ms), sync_bandwidth (bytes/ms)}, the device share's
    gradient bytes. Raises ValueError for negative values or a W longer than B."""
    return CostModel(
        t_forward=t_forward,
        t_backward=t_backward,
        t_weight=t_weight,
        t_input=t_input,
        t_forward_deferring=t_forward_deferring,
        t_p2p=comm["latency_ms"],
        p2p_bytes=comm["bytes"],
        p2p_bandwidth=comm["bandwidth"],
        grad_bytes=grad_bytes,
        sync_bandwidth=comm["sync_bandwidth"],
    )


def write_cost_file(path: str, costs: CostModel) -> None:
    """Write ``costs`` as a JSON object of CostModel's fields (those that are not None)."""
    with open(path, "w", encoding="utf-8") as handle:
        json.dump({k: v for k, v in asdict(costs).items() if v is not None}, handle, indent=2)
        handle.write("\n")


def assumed_communication(args: argparse.Namespace, message_bytes: int) -> Dict[str, float]:
    """p2p and all-reduce terms from the flags (one GPU: nothing to measure between GPUs)."""
    return {
        "latency_ms": args.p2p_latency_ms,
        "bytes": float(message_bytes),
        "bandwidth": args.p2p_bandwidth_gbs * 1e6,
        "sync_bandwidth": args.allreduce_bandwidth_gbs * 1e6,
        "source": (
            f"assumed: p2p {args.p2p_latency_ms:g} ms + {args.p2p_bandwidth_gbs:g} GB/s, "
            f"all-reduce bus bandwidth {args.allreduce_bandwidth_gbs:g} GB/s"
        ),
    }


def training_args(args: argparse.Namespace) -> argparse.Namespace:
    """The pretrain scripts' parsed flags for the measured share (one rank, no pipeline).

    The pretrain scripts refuse ``--bf16``/``--fp16`` without a GPU (training on the CPU is
    fp32); the calibration's ``--device cpu`` runs them there for its tests, so the flags are
    checked as on a GPU and the CPU path sets the backend to gloo itself.
    """
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.gpt_args import GPTArguments

    argv = [
        "--tensor-model-parallel-size", str(args.tensor_model_parallel_size),
        "--num-layers", str(args.num_layers),
        "--hidden-size", str(args.hidden_size),
        "--num-attention-heads", str(args.num_attention_heads),
        "--seq-length", str(args.seq_length),
        "--micro-batch-size", str(args.micro_batch_size),
        "--seed", str(args.seed),
        # required by the parser, unused here (no optimizer step)
        "--train-iters", "1",
        "--lr", "1e-4",
        "--vocab-size", str(VOCAB_SIZE),
    ]
    if args.ffn_hidden_size is not None:
        argv += ["--ffn-hidden-size", str(args.ffn_hidden_size)]
    if args.transformer_impl is not None:
        argv += ["--transformer-impl", args.transformer_impl]
    if args.attention_backend is not None:
        argv += ["--attention-backend", args.attention_backend]
    if args.num_experts is not None:
        argv += ["--num-experts", str(args.num_experts), "--moe-router-topk", str(args.moe_router_topk)]
    argv += ["--sequence-parallel"] if args.sequence_parallel else []
    argv += ["--disable-bias-linear"] if args.disable_bias_linear else []
    argv += ["--bf16"] if args.bf16 else ["--fp16"] if args.fp16 else []
    argv += ["--distributed-backend", "gloo"] if args.device == "cpu" else []
    return parse_args(GPTArguments(), argv, world_size=args.tensor_model_parallel_size, cuda_available=True)


def share_shape(args: argparse.Namespace) -> Tuple[int, int, int]:
    """``(s, b, h)`` of the activation a middle stage receives: ``s / tp`` with sequence parallelism."""
    tp = args.tensor_model_parallel_size if args.sequence_parallel else 1
    return args.seq_length // tp, args.micro_batch_size, args.hidden_size


def build_share(train_args: argparse.Namespace, device):
    """One device share as a middle pipeline stage of training holds it: ``(model, config)``.

    ``model`` is the project's DDP-wrapped GPTModel chunk of ``train_args.num_layers`` layers
    of the run's model kind (dense, or mixture-of-experts with ``--num-experts``) without
    embedding or head (``ChunkFloat16Module`` inside with bf16/fp16), on ``device``. Needs an
    initialised default process group of ``--tensor-model-parallel-size`` ranks (collective
    over it).
    """
    from megatron_bitpipe.model.build import init_megatron_state
    from megatron_bitpipe.execution.groups import ParallelGrid, PipelineGroups
    from megatron_bitpipe.model.chunks import build_chunks, gpt_chunk_factory
    from megatron_bitpipe.model.experts import check_expert_layout
    from megatron_bitpipe.model.precision import ChunkFloat16Module
    from megatron_bitpipe.execution.replicas import wrap_ddp
    from megatron_bitpipe.run_config import RunConfig
    from megatron_bitpipe.training.config import ddp_config, transformer_config, use_global_tp_group
    from megatron_bitpipe.training.gpt import GPTTask
    from megatron_bitpipe.training.model_registry import model_kind_for

    run = RunConfig.from_args(train_args)
    config = transformer_config(run)
    kind = model_kind_for(GPTTask.name, run)
    grid = ParallelGrid(tp=run.layout.tensor)
    check_expert_layout(config, grid)  # also makes megatron-core's MoE layers run without Transformer Engine
    groups = PipelineGroups.build(grid, run.placement)
    use_global_tp_group(groups.tp)
    init_megatron_state(groups.rank_pgs, train_args.seed)
    make_gpt_chunk = gpt_chunk_factory(
        config,
        vocab_size=VOCAB_SIZE,
        max_sequence_length=train_args.max_position_embeddings,
        position_embedding_type=train_args.position_embedding_type,
        rotary_base=train_args.rotary_base,
        layer_spec=kind.layer_spec(run, config),  # SDPA's core attention under --attention-backend sdpa
    )

    def middle_stage(chunk_config, spec, pgs, tie):  # no embedding, no head: what a middle stage holds
        return make_gpt_chunk(chunk_config, dataclasses.replace(spec, pre_process=False, post_process=False), pgs, False)

    (chunk,) = build_chunks(config, groups, middle_stage, vocab_size=VOCAB_SIZE)
    chunk.to(device)
    if config.bf16 or config.fp16:
        chunk = ChunkFloat16Module(config, chunk)
    (model,) = wrap_ddp([chunk], groups, config, ddp_config(run))
    return model, config


def dtype_problems(model, config, hidden) -> List[str]:
    """What would make a GPU's kernels refuse the share: a floating parameter not in
    ``config.params_dtype`` (as megatron's ``Float16Module`` leaves none) or an input not in
    ``config.pipeline_dtype``. CPU kernels accept such mixtures (layer_norm of a bf16 input
    with fp32 weights), CUDA's do not ("expected scalar type BFloat16 but found Float")."""
    problems = [
        f"{name} is {param.dtype}"
        for name, param in model.named_parameters()
        if param.is_floating_point() and param.dtype != config.params_dtype
    ]
    if hidden.dtype != config.pipeline_dtype:
        problems.append(f"the input activation is {hidden.dtype}")
    return [f"{p}, not {config.params_dtype}" for p in problems]


def measure_share(model, config, shape, timer: Callable, warmup: int, iters: int, device) -> Dict[str, object]:
    """Median times (ms) of ``model`` (a :func:`build_share` chunk) on one micro-batch of
    ``shape`` = (s, b, h), and its parameter count.

    Each iteration runs a whole step (``F``, ``B``) and, when the share's linears defer
    (megatron-core local layers), a split one: ``F`` and ``I`` (``backward_step``) with
    ``delay_wgrad_compute`` set on the linears' config, as the executor runs them, and ``W``
    (the chunk's :meth:`~megatron_bitpipe.execution.weight_grad.ChunkWeightGrad.backward_dw`): five ``timer``
    calls per iteration in the order F, B, F_d, I, W (three without the split). ``timer(fn)`` runs
    ``fn`` and returns its duration in ms. Returns ``t_forward``, ``t_backward``,
    ``t_forward_deferring``, ``t_input``, ``t_weight`` (the last three None without the split),
    ``parameters``, ``layer_impl``, ``dtype``, ``output_dtypes`` (what the next stage would
    receive), ``split_note``. Raises RuntimeError naming
    parameters in the wrong dtype (:func:`dtype_problems`) before timing anything.
    """
    import torch
    from megatron.core.pipeline_parallel.schedules import deallocate_output_tensor, forward_step

    from megatron_bitpipe.megatron_compat import backward_step
    from megatron_bitpipe.model.chunks import transformer_block_of
    from megatron_bitpipe.execution.weight_grad import ChunkWeightGrad, SplitBackwardError, enable_split_backward

    s, b, h = shape
    generator = torch.Generator(device="cpu").manual_seed(1234)
    hidden = torch.randn(shape, generator=generator).to(device=device, dtype=config.pipeline_dtype)
    grad = torch.randn(shape, generator=generator).to(device=device, dtype=config.pipeline_dtype)
    problems = dtype_problems(model, config, hidden)
    if problems:
        raise RuntimeError("the measured share does not run as training runs it: " + "; ".join(problems))
    try:
        enable_split_backward([model])
        split_note = None
    except SplitBackwardError as error:
        split_note = f"I and W not measured: {error}"
    weight_grads = ChunkWeightGrad(model)
    deferring_configs = {id(m.config): m.config for _, m in weight_grads.modules if "wgrad_queue" in m.__dict__}

    def defer(on: bool) -> None:
        """Local linears defer while their config has ``delay_wgrad_compute`` (read at forward time)."""
        for deferring_config in deferring_configs.values():
            deferring_config.delay_wgrad_compute = on
    batch = {
        "tokens": torch.zeros((b, s), dtype=torch.long, device=device),
        "position_ids": torch.arange(s, device=device).expand(b, s),
        "labels": torch.zeros((b, s), dtype=torch.long, device=device),
    }

    def forward_step_func(data_iterator, chunk):  # a middle stage: the input tensor is the activation
        data = next(data_iterator)
        return chunk(data["tokens"], data["position_ids"], None, labels=data["labels"]), None

    def run(deferring: bool):
        """One F then its backward, the linears deferring or not; the times (ms)."""
        defer(deferring)
        input_tensor = hidden.detach().requires_grad_()
        outputs: List = []
        t_f = timer(lambda: outputs.append(forward_step(
            forward_step_func, iter([batch]), model, 1, input_tensor, [], config, 1, False,
            is_first_microbatch=False, current_microbatch=0, is_last_stage=False,
        )[0]))
        output = outputs[0]
        output_dtypes.add(str(output.dtype))
        deallocate_output_tensor(output, config.deallocate_pipeline_outputs)  # as after its send
        t_b = timer(lambda: backward_step(input_tensor, output, grad, config))
        return t_f, t_b

    times: Dict[str, List[float]] = {k: [] for k in ("F", "B", "Fd", "I", "W")}
    output_dtypes = set()
    with model.no_sync():
        for iteration in range(warmup + iters):
            model.zero_grad_buffer()
            t_f, t_b = run(deferring=False)
            kept = iteration >= warmup
            if kept:
                times["F"].append(t_f)
                times["B"].append(t_b)
            if split_note is None:
                t_fd, t_i = run(deferring=True)
                t_w = timer(weight_grads.backward_dw)
                if kept:
                    times["Fd"].append(t_fd)
                    times["I"].append(t_i)
                    times["W"].append(t_w)
    median = {k: (statistics.median(v) if v else None) for k, v in times.items()}
    block = transformer_block_of(model)
    return {
        "t_forward": median["F"],
        "t_backward": median["B"],
        "t_forward_deferring": median["Fd"],
        "t_input": median["I"],
        "t_weight": median["W"],
        "parameters": sum(p.numel() for p in model.parameters()),
        "layer_impl": type(block.layers[0].self_attention.linear_qkv).__name__,
        "dtype": str(config.params_dtype).removeprefix("torch."),
        "output_dtypes": sorted(output_dtypes),
        "split_note": split_note,
    }


def _cpu_timer(fn) -> float:
    start = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - start)


def _cuda_timer(fn) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _nccl_probe(rank: int, port: int, message_bytes: int, gradient_bytes: int, iters: int, results) -> None:
    """Spawned on GPUs 0 and 1: p2p one-way times (4 bytes, one message) and all-reduce."""
    import time

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    def ping_pong_ms(message) -> float:
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            if rank == 0:
                dist.send(message, 1)
                dist.recv(message, 1)
            else:
                dist.recv(message, 0)
                dist.send(message, 0)
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - start) / (2 * iters)

    def one_way_ms(nbytes: int) -> float:
        message = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device="cuda")
        ping_pong_ms(message)  # warm-up: NCCL sets up the connection on first use
        return ping_pong_ms(message)

    small, large = one_way_ms(4), one_way_ms(message_bytes)
    measured_bytes = min(gradient_bytes, MAX_ALLREDUCE_BYTES)
    buffer = torch.zeros(measured_bytes // 2, dtype=torch.bfloat16, device="cuda")
    times = []
    for _ in range(1 + iters):
        torch.cuda.synchronize()
        dist.barrier()
        start = time.perf_counter()
        dist.all_reduce(buffer)
        torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    if rank == 0:
        results.put((small, large, statistics.median(times[1:]) * gradient_bytes / measured_bytes))
    dist.destroy_process_group()


def measured_communication(message_bytes: int, gradient_bytes: int, iters: int) -> Dict[str, float]:
    """NCCL between GPUs 0 and 1 (see the module docstring)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    context = mp.get_context("spawn")
    results = context.SimpleQueue()
    mp.start_processes(
        _nccl_probe, args=(port, message_bytes, gradient_bytes, iters, results), nprocs=2, start_method="spawn"
    )
    small, large, pair_allreduce_ms = results.get()
    bandwidth = (message_bytes - 4) / max(large - small, 1e-6)
    return {
        "latency_ms": small,
        "bytes": float(message_bytes),
        "bandwidth": bandwidth,
        "sync_bandwidth": gradient_bytes / max(pair_allreduce_ms, 1e-6),  # bus bandwidth of a 2-rank ring
        "source": "measured with NCCL between GPU 0 and GPU 1",
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-layers", type=int, required=True, help="layers of one device share (L / D)")
    parser.add_argument("--hidden-size", type=int, required=True)
    parser.add_argument("--num-attention-heads", type=int, required=True)
    parser.add_argument("--ffn-hidden-size", type=int, default=None, help="default 4 x hidden size")
    parser.add_argument("--seq-length", type=int, required=True)
    parser.add_argument("--micro-batch-size", type=int, required=True)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1,
                        help="one tensor-parallel rank's share, measured on that many ranks (torchrun)")
    parser.add_argument("--sequence-parallel", action="store_true", help="as training's (needs TP > 1)")
    parser.add_argument("--num-experts", type=int, default=None, help="a mixture-of-experts share (local MoE layers)")
    parser.add_argument("--moe-router-topk", type=int, default=2, help="with --num-experts")
    parser.add_argument("--disable-bias-linear", action="store_true", help="as training's (linears without biases)")
    precision = parser.add_mutually_exclusive_group()
    precision.add_argument("--bf16", action="store_true", help="as training's --bf16 (default fp32)")
    precision.add_argument("--fp16", action="store_true", help="as training's --fp16 (default fp32)")
    parser.add_argument("--transformer-impl", choices=("transformer_engine", "local"), default=None,
                        help="default: training's (transformer_engine on a GPU when importable, else local); "
                        "I and W are measured with local layers only")
    parser.add_argument("--attention-backend", choices=("auto", "local", "sdpa"), default=None,
                        help="as training's (default auto); sdpa: torch's scaled_dot_product_attention as the "
                        "local layers' core attention")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--seed", type=int, default=1234, help="seed of the weights and inputs")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default; exit status 2 without a GPU) or cpu (tests and demos: gloo and the "
                        "CPU compatibility layer; the times are the CPU's)")
    parser.add_argument("--p2p-latency-ms", type=float, default=0.02, help="used with fewer than 2 GPUs")
    parser.add_argument("--p2p-bandwidth-gbs", type=float, default=100.0, help="used with fewer than 2 GPUs")
    parser.add_argument("--allreduce-bandwidth-gbs", type=float, default=100.0, help="used with fewer than 2 GPUs")
    parser.add_argument("--output", default="costs.json", help="cost file to write")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """ValueError naming the flag for sizes megatron-core would reject."""
    for flag in ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "micro_batch_size", "iters",
                 "tensor_model_parallel_size"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: must be >= 1")
    if args.warmup < 0:
        raise ValueError("--warmup: must be >= 0")
    if args.hidden_size % args.num_attention_heads:
        raise ValueError("--num-attention-heads: must divide --hidden-size")
    if min(args.p2p_latency_ms, args.p2p_bandwidth_gbs, args.allreduce_bandwidth_gbs) < 0 or not (
        args.p2p_bandwidth_gbs and args.allreduce_bandwidth_gbs
    ):
        raise ValueError("--p2p-*/--allreduce-bandwidth-gbs: latency >= 0, bandwidths > 0")


def _start_distributed(train_args: argparse.Namespace, device) -> bool:
    """The default process group of the share's ``--tensor-model-parallel-size`` ranks:
    training's own start-up (:func:`megatron_bitpipe.training.distributed.initialize`: NCCL on
    a GPU, gloo and the CPU compatibility layer without one); an existing group of that size
    (a test launcher's) is used. Returns whether it was started here."""
    import torch
    import torch.distributed as dist

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    ranks = train_args.tensor_model_parallel_size
    if dist.is_initialized():
        if dist.get_world_size() != ranks:
            raise RuntimeError(f"the calibration runs on {ranks} rank(s); torch.distributed has {dist.get_world_size()}")
        if device.type == "cpu":
            enable_cpu_megatron()
        return False
    if device.type == "cpu" and torch.cuda.is_available():  # a GPU machine measuring its CPU: one gloo rank
        if ranks != 1:
            raise RuntimeError("--device cpu on a machine with a GPU measures one rank (--tensor-model-parallel-size 1)")
        enable_cpu_megatron()
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        return True
    from megatron_bitpipe.run_config import RunConfig
    from megatron_bitpipe.training.distributed import initialize

    initialize(RunConfig.from_args(train_args), cpu_fallback=enable_cpu_megatron)
    return True


def main(argv: Optional[List[str]] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        check_args(args)
    except ValueError as error:
        parser.error(str(error))
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, f"{parser.prog}: error: {NO_GPU}\n")
    import torch.distributed as dist

    from megatron_bitpipe.megatron_args import BitPipeConfigError
    from megatron_bitpipe.run_config import RunConfig
    from megatron_bitpipe.training.config import ddp_config
    from megatron_bitpipe.usage import UsageError

    try:
        train_args = training_args(args)
    except (BitPipeConfigError, UsageError) as error:
        parser.error(" ".join(str(error).split()))
    device = torch.device(args.device)
    started = _start_distributed(train_args, device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    model, config = build_share(train_args, device)
    shape = share_shape(args)
    timer = _cuda_timer if device.type == "cuda" else _cpu_timer
    compute = measure_share(model, config, shape, timer, args.warmup, args.iters, device)
    del model
    rank = dist.get_rank()
    if started:
        dist.destroy_process_group()
    if rank != 0:
        return 0

    element = torch.tensor([], dtype=config.pipeline_dtype).element_size()
    message_bytes = shape[0] * shape[1] * shape[2] * element  # one [s (/ tp with sequence parallelism), b, h] message
    gradient_element = 4 if ddp_config(RunConfig.from_args(train_args)).grad_reduce_in_fp32 else config.params_dtype.itemsize
    gradient_bytes = compute["parameters"] * gradient_element
    if device.type == "cuda" and torch.cuda.device_count() >= 2:
        comm = measured_communication(message_bytes, gradient_bytes, args.iters)
    else:
        comm = assumed_communication(args, message_bytes)
    costs = cost_model(compute["t_forward"], compute["t_backward"], comm, gradient_bytes,
                       t_weight=compute["t_weight"], t_input=compute["t_input"],
                       t_forward_deferring=compute["t_forward_deferring"])
    write_cost_file(args.output, costs)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    f = costs.t_forward
    print(
        f"{name}, {config.transformer_impl} layers ({compute['layer_impl']}), {compute['dtype']} "
        f"(as training runs a middle pipeline stage): {args.num_layers} layers, h={args.hidden_size}, "
        f"s={args.seq_length}, b={args.micro_batch_size}, {compute['parameters'] / 1e6:.1f}M parameters"
    )
    print(f"F {f:.3f} ms, B {costs.t_backward:.3f} ms ({costs.t_backward / f:.2f} F) (median of {args.iters})")
    if compute["split_note"] is None:
        print(
            f"split backward (execution.weight_grad deferral): F while deferring {costs.t_forward_deferring:.3f} ms "
            f"({costs.t_forward_deferring / f:.2f} F), "
            f"I {costs.t_input:.3f} ms ({costs.t_input / f:.2f} F), W {costs.t_weight:.3f} ms ({costs.t_weight / f:.2f} F), "
            f"I + W = {(costs.t_input + costs.t_weight) / costs.t_backward:.2f} B"
        )
    else:
        print(compute["split_note"])
    print(
        f"communication {comm['source']}: p2p {costs.message_time:.4f} ms per message, gradient all-reduce of "
        f"the device share over a replica pair {costs.sync_time(1.0, 2):.3f} ms"
    )
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
