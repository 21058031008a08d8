"""Extract model K of a fused-array (``--hfta-models``) checkpoint as an ordinary GPT or BERT checkpoint.

    python scripts/hfta_extract.py --load CKPT_DIR --model 2 --save MODEL2_DIR [--ckpt-step N]

The result loads into ``scripts/pretrain_gpt.py`` (``pretrain_bert.py``) like any checkpoint of the unfused model
(weights only: pass ``--no-load-optim`` to continue training it, or ``--finetune``); its saved
arguments have ``--lr`` model K's rate. docs/hfta.md. Exit status 2 for a bad request.
"""

import argparse
import sys

from megatron_bitpipe.training.script import ignore_dependency_warnings

ignore_dependency_warnings()  # megatron-core's notes on the kernels it does not find, as the pretrain scripts


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--load", required=True, help="the fused array's checkpoint directory (--save of its run)")
    parser.add_argument("--model", type=int, required=True, help="which model of the array (0-based)")
    parser.add_argument("--save", required=True, help="where to write model K's checkpoint")
    parser.add_argument("--ckpt-step", type=int, default=None, help="iteration to extract (default: the latest)")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    from megatron_bitpipe.cpu.compat import enable_cpu_megatron
    from megatron_bitpipe.hfta.extract import extract_model

    if not torch.cuda.is_available():
        enable_cpu_megatron()
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        directory = extract_model(args.load, args.model, args.save, args.ckpt_step)
    except ValueError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    print(f"model {args.model} of {args.load} written to {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
