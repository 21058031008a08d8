"""The optimizers and schedules of megatron_bitpipe.optimizers, against references.

* REX: values at z = 0, 1/2, 1, monotonic, beta = 0 is megatron's linear decay, and
  pytorch_optimizer's REXScheduler (beta = 1/2) as an oracle; WSD's annealing phase too.
* LAMB equals a plain single-tensor implementation of the algorithm; 1-bit LAMB's warm-up
  equals LAMB bit for bit.
* 1-bit compression: pack/unpack round trip, e = c - s sign(c) exactly, and error feedback:
  the decoded averages of many steps sum to the true averages minus the final errors, with
  errors that stay bounded.
* Schedule-Free AdamW: the eval -> train round trip is exact; wrapped in megatron's
  FP32Optimizer (built by the factory over megatron's parameter groups) it equals
  ``schedulefree.AdamWScheduleFree`` on identical gradients for 25 steps including warm-up
  (train and averaged weights, rtol 1e-6); with bf16 model weights (``Float16OptimizerWithFloat16Params``)
  the model holds bf16(x) while evaluating and bf16(y) exactly again afterwards.
* 1-bit LAMB on 2 ranks (two DDP chunks, eager exchange) leaves both ranks bitwise identical
  and equals a single-process simulation of the same algorithm (warm-up and compression); a
  megatron sharded (torch_dist) checkpoint saved in the compression stage resumes it bit for
  bit (per-rank error feedback and coefficients included).
"""

from __future__ import annotations

import math
import multiprocessing
import types

import pytest
import torch

from megatron_bitpipe.cpu.launcher import launch
from megatron_bitpipe.optimizers import ParamScheduler, rex_coefficient
from megatron_bitpipe.optimizers.compression import average_in_process, compress, pack_bits, padded_size, unpack_bits
from megatron_bitpipe.optimizers.lamb import Lamb
from megatron_bitpipe.optimizers.onebit_lamb import OnebitLamb


def _scheduler(style: str, beta: float = 0.5, warmup: int = 0, decay: int = 20, **kw) -> ParamScheduler:
    holder = types.SimpleNamespace(param_groups=[{"params": [], "max_lr": 1.0, "min_lr": 0.1, "lr_mult": 1.0, "wd_mult": 1.0}])
    return ParamScheduler(
        holder, rex_beta=beta, init_lr=0.0, max_lr=1.0, min_lr=0.1, lr_warmup_steps=warmup, lr_decay_steps=decay,
        lr_decay_style=style, start_wd=0.0, end_wd=0.0, wd_incr_steps=decay, wd_incr_style="constant", **kw,
    )  # fmt: skip


def _lrs(scheduler: ParamScheduler, steps: int):
    values = []
    for _ in range(steps):
        values.append(scheduler.get_lr(scheduler.optimizer.param_groups[0]))
        scheduler.step(1)
    return values


def test_rex_values_and_monotonic():
    assert rex_coefficient(0.0, 0.5) == 1.0 and rex_coefficient(1.0, 0.5) == 0.0
    assert rex_coefficient(0.5, 0.5) == pytest.approx(2 / 3)
    lrs = _lrs(_scheduler("rex", warmup=4, decay=24), 30)
    assert lrs[:5] == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    decay = lrs[4:25]
    assert all(a > b for a, b in zip(decay, decay[1:])) and decay[-1] == pytest.approx(0.1)
    assert lrs[14] == pytest.approx(0.1 + 0.9 * 2 / 3)  # z = 1/2
    assert lrs[25:] == pytest.approx([0.1] * 5)
    with pytest.raises(ValueError, match="--rex-beta"):
        _scheduler("rex", beta=1.0)


def test_rex_beta_zero_is_linear():
    assert _lrs(_scheduler("rex", beta=0.0, warmup=3), 25) == pytest.approx(_lrs(_scheduler("linear", warmup=3), 25), rel=1e-12)


def test_rex_equals_pytorch_optimizer_oracle():
    rex = pytest.importorskip("pytorch_optimizer.lr_scheduler.rex")
    param = torch.nn.Parameter(torch.zeros(1))
    oracle = rex.REXScheduler(torch.optim.SGD([param], lr=1.0), total_steps=20, max_lr=1.0, min_lr=0.1)
    expected = [oracle.step() for _ in range(20)]  # torch's scheduler took step 0 when built: steps 1..20
    assert _lrs(_scheduler("rex", beta=0.5, decay=20), 21)[1:] == pytest.approx(expected, rel=1e-12)


def test_rex_as_wsd_annealing():
    lrs = _lrs(_scheduler("WSD", decay=20, wsd_decay_steps=10, lr_wsd_decay_style="rex"), 21)
    assert lrs[:11] == pytest.approx([1.0] * 11)
    assert lrs[15] == pytest.approx(0.1 + 0.9 * rex_coefficient(0.5, 0.5)) and lrs[20] == pytest.approx(0.1)


def _reference_lamb(w, grads, lr, betas, eps, wd, low, high):
    """LAMB on one tensor, written out step by step (float64)."""
    w = w.double().clone()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        u = (m / (1 - betas[0] ** t)) / (torch.sqrt(v / (1 - betas[1] ** t)) + eps) + wd * w
        ratio = min(max((w.norm() / u.norm()).item(), low), high)
        w = w - lr * ratio * u
    return w


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lamb_equals_single_tensor_reference(wd):
    torch.manual_seed(0)
    shapes = [(5, 7), (7,), (3, 2, 4)]
    weights = [torch.randn(s) for s in shapes]
    grads = [[torch.randn(s) for s in shapes] for _ in range(8)]
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    lamb = Lamb(params, lr=0.05, betas=(0.9, 0.99), eps=1e-6, weight_decay=wd, min_coeff=0.01, max_coeff=10.0)
    for step in grads:
        for p, g in zip(params, step):
            p.grad = g.clone()
        lamb.step()
    for i, p in enumerate(params):
        expected = _reference_lamb(weights[i], [step[i] for step in grads], 0.05, (0.9, 0.99), 1e-6, wd, 0.01, 10.0)
        torch.testing.assert_close(p.detach().double(), expected, rtol=1e-6, atol=1e-7)


def test_lamb_trust_ratio_is_clipped():
    p = torch.nn.Parameter(torch.full((4,), 100.0))
    p.grad = torch.ones(4)
    Lamb([p], lr=0.1, min_coeff=0.01, max_coeff=2.0).step()
    assert torch.allclose(p.detach(), torch.full((4,), 100.0 - 0.1 * 2.0 * 1.0), rtol=1e-5)


def test_onebit_lamb_warmup_equals_lamb_bitwise():
    torch.manual_seed(1)
    shapes = [(6, 3), (3,)]
    a = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    lamb = Lamb(a, lr=0.01, weight_decay=0.05)
    onebit = OnebitLamb(b, freeze_step=100, lr=0.01, weight_decay=0.05)
    for _ in range(6):
        grads = [torch.randn(s) for s in shapes]
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        lamb.step()
        onebit.step()
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert all(torch.equal(lamb.state[p]["exp_avg_sq"], onebit.state[q]["exp_avg_sq"]) for p, q in zip(a, b))


def test_pack_unpack_round_trip():
    bits = torch.rand(8 * 37, generator=torch.Generator().manual_seed(3)) > 0.5
    packed = pack_bits(bits)
    assert packed.dtype == torch.uint8 and packed.numel() == 37
    assert torch.equal(unpack_bits(packed), bits)
    assert pack_bits(torch.tensor([True] + [False] * 7)).item() == 1  # element 8j + i is bit i
    with pytest.raises(ValueError):
        pack_bits(torch.ones(9, dtype=torch.bool))


def test_compressor_error_is_exact():
    c = torch.randn(64)
    c[3] = 0.0
    scale, bits, error = compress(c)
    sign = torch.where(c >= 0, 1.0, -1.0)
    assert scale.item() == pytest.approx(c.norm().item() / 8.0)
    assert torch.equal(error, c - scale * sign) and bits[3]


def test_error_feedback_keeps_accumulated_error_bounded():
    world, numel, steps = 4, padded_size(100, 4), 300
    gen = torch.Generator().manual_seed(5)
    workers = [torch.zeros(numel) for _ in range(world)]
    servers = [torch.zeros(numel // world) for _ in range(world)]
    drift = torch.randn(numel, generator=gen)
    sent, received, error_norms = torch.zeros(numel, dtype=torch.float64), torch.zeros(numel, dtype=torch.float64), []
    for _ in range(steps):
        vectors = [drift + 0.5 * torch.randn(numel, generator=gen) for _ in range(world)]
        sent += torch.stack(vectors).double().mean(dim=0)
        received += average_in_process(vectors, workers, servers).double()
        residual = torch.stack(workers).double().mean(dim=0) + torch.cat(servers).double()
        torch.testing.assert_close(received + residual, sent, rtol=0, atol=1e-3)  # telescoping sums
        error_norms.append((sent - received).norm().item())
    assert max(error_norms[steps // 2 :]) < 3 * max(error_norms[: steps // 10])  # bounded, not growing with t
    assert error_norms[-1] < 0.05 * sent.norm().item()


def test_schedule_free_round_trip_is_exact():
    pytest.importorskip("schedulefree")
    from megatron_bitpipe.optimizers.schedule_free import ScheduleFreeAdamW

    torch.manual_seed(2)
    p = torch.nn.Parameter(torch.randn(50))
    opt = ScheduleFreeAdamW([p], lr=0.05, warmup_steps=2)
    for _ in range(5):
        p.grad = torch.randn(50)
        opt.step()
    y = p.detach().clone()
    opt.eval()
    x = p.detach().clone()
    assert not torch.equal(x, y) and "y" in opt.state[p]
    opt.train()
    assert torch.equal(p.detach(), y) and "y" not in opt.state[p]
    opt.eval()
    assert torch.equal(p.detach(), x)


# -- launched: megatron's wrappers need torch.distributed and the CPU layer --------------


def _sf_wrapper_rank(steps: int, warmup: int) -> dict:
    import schedulefree
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.optimizers import OptimizerChoice, averaged_weights, build_megatron_optimizer

    enable_cpu_megatron()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3))
    world = dist.group.WORLD
    config = OptimizerConfig(lr=0.02, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.99, adam_eps=1e-8, clip_grad=0.0)
    optimizer = build_megatron_optimizer(
        config, OptimizerChoice("schedulefree_adamw", sf_warmup_iters=warmup), [model], pg_collection=ProcessGroupCollection(tp=world, mp=world)
    )
    scheduler = ParamScheduler(
        optimizer, init_lr=0.0, max_lr=0.02, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=100, lr_decay_style="constant",
        start_wd=0.1, end_wd=0.1, wd_incr_steps=100, wd_incr_style="constant",
    )  # fmt: skip
    clones = {p: torch.nn.Parameter(p.detach().clone()) for p in model.parameters()}
    inner = optimizer.chained_optimizers[0].optimizer
    groups = [{"params": [clones[p] for p in g["params"]], "lr": g["lr"], "weight_decay": g["weight_decay"]} for g in inner.param_groups]
    assert sorted(g["weight_decay"] for g in groups) == [0.0, pytest.approx(0.1)]  # megatron's no-decay group
    reference = schedulefree.AdamWScheduleFree(groups, betas=(0.9, 0.99), eps=1e-8, warmup_steps=warmup)
    reference.train()
    gen = torch.Generator().manual_seed(1)
    worst = {"train": 0.0, "eval": 0.0}

    def rel(a, b):
        return ((a - b).abs().max() / b.abs().max()).item()

    for step in range(steps):
        for p in model.parameters():
            g = torch.randn(p.shape, generator=gen)
            p.main_grad, clones[p].grad = g.clone(), g.clone()
        optimizer.step()
        reference.step()
        scheduler.step(1)
        for p in model.parameters():
            worst["train"] = max(worst["train"], rel(p.detach(), clones[p].detach()))
        if step % 4 == 3:
            with averaged_weights(optimizer):
                for p in model.parameters():
                    z = reference.state[clones[p]]["z"]
                    x = clones[p].detach().lerp(z, 1 - 1 / 0.9)  # the package's eval() of y
                    worst["eval"] = max(worst["eval"], rel(p.detach(), x))
    worst["bf16"] = _sf_bf16_refresh(pytest, world)
    return worst


def _sf_bf16_refresh(pytest, world) -> bool:
    """With bf16 model weights (fp32 main parameters), the model holds bf16(x) inside
    averaged_weights and bf16(y) again after it."""
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_bitpipe.optimizers import OptimizerChoice, averaged_weights, build_megatron_optimizer

    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6)).to(torch.bfloat16)
    config = OptimizerConfig(lr=0.02, bf16=True, params_dtype=torch.bfloat16, clip_grad=0.0)
    optimizer = build_megatron_optimizer(config, OptimizerChoice("schedulefree_adamw"), [model], pg_collection=ProcessGroupCollection(tp=world, mp=world))
    part = optimizer.chained_optimizers[0]
    for _ in range(3):
        for p in model.parameters():
            p.main_grad = torch.randn(p.shape)
        optimizer.step()
    mains = [m for group in part.fp32_from_float16_groups for m in group]
    models = [p for group in part.float16_groups for p in group]
    y = [m.detach().clone() for m in mains]
    with averaged_weights(optimizer):
        inside = all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(models, mains))
        moved = any(not torch.equal(m, yy) for m, yy in zip(mains, y))
    after = all(torch.equal(p, yy.to(torch.bfloat16)) and torch.equal(m, yy) for p, m, yy in zip(models, mains, y))
    return inside and moved and after


@pytest.mark.multirank
def test_schedule_free_in_megatron_wrapper_equals_package():
    pytest.importorskip("schedulefree")
    worst = launch(_sf_wrapper_rank, 1, 25, 5, timeout=300)[0]
    assert worst["train"] < 1e-6 and worst["eval"] < 1e-6, worst
    assert worst["bf16"], "bf16 model weights not refreshed from the fp32 main parameters"


def _onebit_setup(freeze: int):
    import torch.distributed as dist
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.transformer import TransformerConfig

    from megatron_bitpipe.optimizers import OptimizerChoice, build_megatron_optimizer
    from megatron_bitpipe.execution.groups import new_groups, process_group_collection
    from megatron_bitpipe.execution.replicas import ChunkDistributedDataParallel

    world, rank = dist.get_world_size(), dist.get_rank()
    solo = new_groups([[r] for r in range(world)], rank)
    pgs = process_group_collection(tp=solo, pp=solo, dp=dist.group.WORLD, mp=solo, solo=solo, world=dist.group.WORLD)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, use_cpu_initialization=True)
    torch.manual_seed(0)
    modules = [torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.LayerNorm(7)), torch.nn.Linear(7, 3)]
    ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=True, grad_reduce_in_fp32=True)
    chunks = [ChunkDistributedDataParallel(config, ddp_config, m, disable_bucketing=True, pg_collection=pgs) for m in modules]
    opt_config = OptimizerConfig(lr=0.01, weight_decay=0.05, adam_beta1=0.9, adam_beta2=0.99, adam_eps=1e-8, clip_grad=0.0)
    optimizer = build_megatron_optimizer(opt_config, OptimizerChoice("onebit_lamb", onebit_freeze_iters=freeze), chunks, pg_collection=pgs)
    scheduler = ParamScheduler(
        optimizer, init_lr=0.0, max_lr=0.01, min_lr=0.0, lr_warmup_steps=0, lr_decay_steps=100, lr_decay_style="constant",
        start_wd=0.05, end_wd=0.05, wd_incr_steps=100, wd_incr_style="constant",
    )  # fmt: skip
    return chunks, optimizer, scheduler


def _local_grad(step: int, rank: int, index: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 * step + 100 * rank + index))


def _onebit_rank(steps: int, freeze: int, checkpoint: str, save_at: int) -> dict:
    """Rank body: ``steps`` steps of 1-bit LAMB over two DDP chunks on synthetic local
    gradients; after step ``save_at`` a megatron sharded (torch_dist) checkpoint is saved and
    a second, freshly built optimizer loads it and runs the remaining steps alongside."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing import ShardedTensor

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    enable_cpu_megatron()
    rank = dist.get_rank()
    multiprocessing.current_process().daemon = False  # megatron's checkpoint writer forks workers

    def model_sharded(chunks):
        return {
            f"chunk{c}.{name}": ShardedTensor.from_rank_offsets(f"chunk{c}.{name}", p, replica_id=rank)
            for c, chunk in enumerate(chunks)
            for name, p in chunk.module.named_parameters()
        }

    def one_step(step, chunks, optimizer, scheduler):
        params = [p for c in chunks for p in c.module.parameters()]
        for chunk in chunks:
            chunk.zero_grad_buffer()
        for index, p in enumerate(params):
            p.main_grad.copy_(_local_grad(step, rank, index, p.shape))
        for chunk in reversed(chunks):  # as a pipeline: the last chunk's backward finishes first
            chunk.start_grad_sync()
        for chunk in chunks:
            chunk.finish_grad_sync()
        optimizer.step()
        scheduler.step(1)
        return torch.cat([p.detach().reshape(-1) for p in params]).clone()

    chunks, optimizer, scheduler = _onebit_setup(freeze)
    params = [p for c in chunks for p in c.module.parameters()]
    inner = optimizer.chained_optimizers[0].optimizer
    index_of = {id(p): i for i, p in enumerate(params)}
    groups = [([index_of[id(p)] for p in g["params"]], g["weight_decay"], g["lr"]) for g in inner.param_groups]
    history = [torch.cat([p.detach().reshape(-1) for p in params]).clone()]
    resumed = None
    for step in range(steps):
        history.append(one_step(step, chunks, optimizer, scheduler))
        if resumed is not None:
            resumed[3].append(one_step(step, *resumed[:3]))
        if step + 1 == save_at:
            dist_checkpointing.save(optimizer.sharded_state_dict(model_sharded(chunks)), checkpoint)
            chunks2, optimizer2, scheduler2 = _onebit_setup(freeze)
            for p, q in zip(params, [p for c in chunks2 for p in c.module.parameters()]):
                q.data.copy_(p.data)
            loaded = dist_checkpointing.load(optimizer2.sharded_state_dict(model_sharded(chunks2), is_loading=True), checkpoint)
            optimizer2.load_state_dict(loaded)
            scheduler2.load_state_dict(scheduler.state_dict())
            resumed = (chunks2, optimizer2, scheduler2, [])
    return dict(history=history, resumed=resumed[3], groups=groups, compressing=inner.compressing,
                shapes=[tuple(p.shape) for p in params], chunk_sizes=[len(list(c.module.parameters())) for c in chunks])  # fmt: skip


def _simulate_onebit(initial: torch.Tensor, shapes, chunk_sizes, groups, steps: int, freeze: int, world: int):
    """Single-process 1-bit LAMB over ``world`` simulated ranks: their gradients averaged as
    megatron DDP does in the warm-up, their momenta through average_in_process afterwards."""
    params, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        params.append(torch.nn.Parameter(initial[offset : offset + n].reshape(shape).clone()))
        offset += n
    sim = OnebitLamb(
        [{"params": [params[i] for i in idx], "weight_decay": wd, "lr": lr} for idx, wd, lr in groups],
        freeze_step=freeze, lr=0.01, betas=(0.9, 0.99), eps=1e-8,
    )  # fmt: skip
    bounds = [sum(chunk_sizes[:c]) for c in range(len(chunk_sizes) + 1)]
    chunk_params = [params[bounds[c] : bounds[c + 1]] for c in range(len(chunk_sizes))]

    class SimChunk:
        def __init__(self, members):
            self.pairs = [(p, p) for p in members]
            self.numel = sum(p.numel() for p in members)
            self.previous = None
            self.workers = [torch.zeros(padded_size(self.numel, world)) for _ in range(world)]
            self.servers = [torch.zeros(padded_size(self.numel, world) // world) for _ in range(world)]

        def take_previous(self):
            previous, self.previous = self.previous, None
            return previous

    sim.init_state(sim)
    sim.chunks = [SimChunk(members) for members in chunk_params]
    sim._ddp_chunks = [types.SimpleNamespace(gradient_exchange=None) for _ in chunk_params]
    history = [torch.cat([p.detach().reshape(-1) for p in params]).clone()]
    for step in range(steps):
        grads = [[_local_grad(step, r, i, p.shape) for i, p in enumerate(params)] for r in range(world)]
        if not sim.compressing:
            for i, p in enumerate(params):
                p.grad = grads[0][i] * (1 / world) + grads[1][i] * (1 / world)
        else:
            for chunk in sim.chunks:
                members = [p for p, _ in chunk.pairs]
                index = [next(i for i, q in enumerate(params) if q is p) for p in members]
                chunk.previous = [sim.state[p]["exp_avg"].clone() for p in members]
                vectors = []
                for r in range(world):
                    local = [sim.state[p]["exp_avg"].mul(0.9).add_(grads[r][i], alpha=1 - 0.9) for p, i in zip(members, index)]
                    flat = torch.cat([m.reshape(-1) * sim.state[p]["scaling_coeff"] for m, p in zip(local, members)])
                    vectors.append(torch.cat([flat, flat.new_zeros(padded_size(chunk.numel, world) - chunk.numel)]))
                averaged = average_in_process(vectors, chunk.workers, chunk.servers)
                offset = 0
                for p in members:
                    m = sim.state[p]["exp_avg"]
                    m.copy_(averaged[offset : offset + m.numel()].view_as(m) / sim.state[p]["scaling_coeff"])
                    offset += m.numel()
        sim.step()
        history.append(torch.cat([p.detach().reshape(-1) for p in params]).clone())
    return history


@pytest.mark.multirank
def test_onebit_lamb_on_two_ranks_equals_single_process_simulation(tmp_path):
    steps, freeze, save_at = 10, 4, 6
    (tmp_path / "torch_dist").mkdir()
    results = launch(_onebit_rank, 2, steps, freeze, str(tmp_path / "torch_dist"), save_at, timeout=300)
    assert results[0]["compressing"]
    for a, b in zip(results[0]["history"], results[1]["history"]):
        assert torch.equal(a, b)  # every rank holds the same bits after every exchange
    r = results[0]
    expected = _simulate_onebit(r["history"][0], r["shapes"], r["chunk_sizes"], r["groups"], steps, freeze, 2)
    assert not torch.equal(r["history"][freeze + 1], r["history"][freeze])  # compressed steps move the weights
    for step, (got, want) in enumerate(zip(r["history"], expected)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=lambda m: f"step {step}: {m}")
    # resumed from megatron's sharded checkpoint in the compression stage: every state restored
    for rank in results:
        assert len(rank["resumed"]) == steps - save_at
        assert all(torch.equal(a, b) for a, b in zip(rank["resumed"], rank["history"][save_at + 1 :]))


# -- flags ----------------------------------------------------------------------------


def _problems(argv, world_size=1):
    from megatron_bitpipe.megatron_args import BitPipeConfigError
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.gpt import GPTTask

    base = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--train-iters", "4", "--lr", "1e-3", "--vocab-size", "64"]  # fmt: skip
    try:
        parse_args(GPTTask(), [*base, *argv], world_size=world_size, cuda_available=False)
    except BitPipeConfigError as error:
        return str(error)
    return ""


@pytest.mark.parametrize(
    "argv,world,expected",
    [
        (["--optimizer", "onebit_lamb"], 1, "--onebit-freeze-iters"),
        (["--optimizer", "onebit_lamb", "--onebit-freeze-iters", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"], 2, "--sequence-parallel"),
        (["--optimizer", "onebit_lamb", "--onebit-freeze-iters", "2", "--overlap-grad-reduce"], 2, "--overlap-grad-reduce"),
        (["--optimizer", "onebit_lamb", "--onebit-freeze-iters", "2", "--pipeline-model-parallel-size", "2"], 2, "--untie-embeddings-and-output-weights"),
        (["--optimizer", "schedulefree_adamw"], 1, "--lr-decay-style constant"),
        (["--optimizer", "lamb", "--lamb-min-coeff", "2", "--lamb-max-coeff", "1"], 1, "--lamb-min-coeff"),
        (["--lr-decay-style", "rex", "--rex-beta", "1.5"], 1, "--rex-beta"),
    ],
)
def test_unsupported_combinations_are_refused_naming_the_flags(argv, world, expected):
    assert expected in _problems(argv, world)


def test_supported_combinations_pass():
    assert _problems(["--optimizer", "schedulefree_adamw", "--lr-decay-style", "constant", "--lr-warmup-iters", "2"]) == ""
    bitpipe = ["--pipeline-schedule", "bitpipe", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]
    assert _problems(["--optimizer", "onebit_lamb", "--onebit-freeze-iters", "2", *bitpipe], 2) == ""


def test_flags_are_new_to_megatron_lm():
    """None of the added flags is defined by the Megatron-LM checkout (MEGATRON_LM_PATH)."""
    import os
    from pathlib import Path

    root = os.environ.get("MEGATRON_LM_PATH")
    if not root:
        pytest.skip("MEGATRON_LM_PATH is not set")
    source = (Path(root) / "megatron" / "training" / "arguments.py").read_text()
    for flag in ("--rex-beta", "--lamb-min-coeff", "--lamb-max-coeff", "--onebit-freeze-iters", "--sf-weight-lr-power", "--sf-r"):
        assert f"'{flag}'" not in source and f'"{flag}"' not in source, flag
