"""Pretrain a BERT model with megatron-core and megatron-bitpipe (no Megatron-LM checkout needed).

    torchrun --nproc-per-node 4 scripts/pretrain_bert.py --pipeline-schedule bitpipe \\
        --pipeline-model-parallel-size 4 --num-layers 8 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 --global-batch-size 16 \\
        --train-iters 20 --lr 1e-3 --vocab-size 1000

Megatron-LM's flag names (BERT's: ``--bert-no-binary-head``, ``--mask-prob``,
``--short-seq-prob``); ``--help`` lists them (before torch or megatron-core is imported) and
docs/running.md explains them. Without a GPU it trains on the CPU (gloo) through
megatron-bitpipe's CPU compatibility layer.
"""

import sys

from megatron_bitpipe.training.bert_args import BertArguments
from megatron_bitpipe.training.script import ignore_dependency_warnings, run_script

ignore_dependency_warnings()  # megatron-core's notes (apex, Transformer Engine, torch deprecations), every rank


def load_task():
    """The task, imported once the flags are parsed and checked (it imports megatron-core)."""
    from megatron_bitpipe.training.bert import BertTask

    return BertTask()


def cpu_fallback():
    """No GPU: run megatron-core on the CPU with gloo (megatron_bitpipe.cpu)."""
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    return enable_cpu_megatron()


if __name__ == "__main__":
    sys.exit(run_script(BertArguments(), load_task, cpu_fallback=cpu_fallback))
