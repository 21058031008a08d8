"""Convert a checkpoint of megatron-bitpipe's earlier logical format to a distributed checkpoint.

    python scripts/convert_checkpoint.py OLD_DIR NEW_DIR [--ckpt-step N]

``OLD_DIR`` is a ``--save`` directory of the earlier ``scripts/pretrain_gpt.py`` /
``pretrain_bert.py`` (``metadata.json`` with ``"format": "megatron-bitpipe-logical"``; the
latest checkpoint, or iteration ``N``). ``NEW_DIR`` receives the same iteration as a megatron-core
distributed checkpoint (``--ckpt-format torch_dist``, see docs/checkpoints.md), which both
pretrain scripts and Megatron-LM's load in any layout: every weight (the fp32 main weight
where the old checkpoint kept one), Adam's moments and step, the learning-rate schedule, the
iteration and the consumed samples. Not carried over: random generator states (they only
mattered in the saving layout) and an fp16 loss scale (a note says so).

The model is rebuilt in this process from the flags stored in the old checkpoint (one CPU
process, fp32), filled from the old shards and saved with the scripts' own checkpoint code.
Exit status: 0 done, 1 the old checkpoint cannot be read, 2 run under megatron-core 0.17 or
later (the old checkpoints come from 0.16: convert with megatron-core 0.16).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from megatron_bitpipe.training.script import ignore_dependency_warnings

ignore_dependency_warnings()  # megatron-core's notes on apex / Transformer Engine, every rank

import torch  # noqa: E402

_VOCAB_FLAG = "padded vocabulary (--vocab-size, --tokenizer-type)"


def _read(root: str, step):
    from megatron_bitpipe.checkpoint_checks import checkpoint_format, find_checkpoint

    found = find_checkpoint(root, step)
    if found is None:
        raise SystemExit(f"convert_checkpoint: error: {root} holds no checkpoint (no latest_checkpointed_iteration.txt)")
    directory = found[0]
    if checkpoint_format(directory) != "logical":
        raise SystemExit(f"convert_checkpoint: error: {directory} is not in megatron-bitpipe's logical format")
    with open(os.path.join(directory, "metadata.json"), encoding="utf-8") as f:
        return directory, json.load(f)


def _model_argv(signature: dict) -> list:
    """The pretrain scripts' flags for the model the old checkpoint describes."""
    argv = []
    for flag, value in signature.items():
        if flag == _VOCAB_FLAG:
            argv += ["--vocab-size", str(value), "--make-vocab-size-divisible-by", "1"]
        elif flag == "--num-query-groups":
            argv += ["--group-query-attention", flag, str(value)] if value != signature["--num-attention-heads"] else []
        elif isinstance(value, bool):
            argv += [flag] if value else []
        else:
            argv += [flag, str(value)]
    seq = signature["--max-position-embeddings"]
    return argv + ["--seq-length", str(seq), "--train-iters", "1", "--lr", "0", "--eval-iters", "0"]


def convert(old_root: str, new_root: str, step=None) -> str:
    """Write ``old_root``'s checkpoint as a distributed checkpoint under ``new_root``; returns its directory."""
    import torch.distributed as dist
    from megatron.core.utils import unwrap_model

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.training.optimizer import build_optimizer
    from megatron_bitpipe.training import distributed
    from megatron_bitpipe.training.arguments import parse_args
    from megatron_bitpipe.training.bert import BertTask
    from megatron_bitpipe.training.checkpoint import TrainingState, save_checkpoint
    from megatron_bitpipe.run_config import RunConfig
    from megatron_bitpipe.training.config import lr_scheduler, optimizer_config
    from megatron_bitpipe.training.gpt import GPTTask
    from megatron_bitpipe.training.model_registry import model_kind_for

    directory, metadata = _read(old_root, step)
    task = {"gpt": GPTTask, "bert": BertTask}[metadata["task"]]()
    signature = dict(metadata["model"])
    bert_binary_head = not signature.pop("--bert-no-binary-head", False)
    argv = _model_argv(signature) + ([] if bert_binary_head else ["--bert-no-binary-head"])
    argv += ["--use-checkpoint-opt_param-scheduler", "--no-save-rng", "--save", new_root]
    args = parse_args(task, argv, world_size=1, cuda_available=False)
    run = dataclasses.replace(RunConfig.from_args(args, task=task), padded_vocab_size=signature[_VOCAB_FLAG])  # the checkpoint's
    distributed.initialize(run, enable_cpu_megatron)
    try:
        model = model_kind_for(task.name, run).build_model(run)
        optimizer = build_optimizer(model, optimizer_config(run), hfta=run.hfta)
        adam = optimizer.chained_optimizers[0].optimizer  # one fp32 Adam over the single-process model
        shards = {}
        with torch.no_grad():
            for name, param in unwrap_model(model.chunks[0]).named_parameters():
                where = metadata["parameters"][name]["file"]
                if where not in shards:
                    shards[where] = torch.load(os.path.join(directory, where), map_location="cpu", weights_only=True)
                entry = shards[where][name]
                param.copy_(entry.get("main_param", entry["param"]))
                if "exp_avg" in entry:
                    adam.state[param] = {
                        "step": torch.tensor(float(entry["step"])),
                        "exp_avg": entry["exp_avg"].float().clone(),
                        "exp_avg_sq": entry["exp_avg_sq"].float().clone(),
                    }
        common = torch.load(os.path.join(directory, "common.pt"), map_location="cpu", weights_only=False)
        scheduler = lr_scheduler(run, optimizer)
        scheduler.load_state_dict(common["scheduler"])
        if any(scaler is not None for scaler in common.get("grad_scalers", [])):
            distributed.log("note: the fp16 loss scale is not carried over (it restarts at --initial-loss-scale)")
        state = TrainingState(metadata["iteration"], metadata["consumed_train_samples"])
        saved = save_checkpoint(new_root, state, model, optimizer, scheduler, args, run, task)
        distributed.log(f"converted {directory} -> {saved} (iteration {state.iteration}, {state.consumed_train_samples} samples consumed)")
        return saved
    finally:
        dist.destroy_process_group()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("old_dir", help="--save directory of a logical-format checkpoint")
    parser.add_argument("new_dir", help="where to write the distributed checkpoint")
    parser.add_argument("--ckpt-step", type=int, default=None, help="iteration to convert (default: the latest)")
    options = parser.parse_args(argv)
    from megatron_bitpipe import megatron_compat

    if megatron_compat.reads_common_state_in_index():
        print(
            f"{parser.prog}: error: run the conversion with megatron-core 0.16 (the logical format was written with "
            "it; under later releases the converted optimizer state loses its parameter groups); the converted "
            "checkpoint is a regular distributed checkpoint",
            file=sys.stderr,
        )
        return 2
    convert(options.old_dir, options.new_dir, options.ckpt_step)
    return 0


if __name__ == "__main__":
    sys.exit(main())
