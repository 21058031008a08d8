"""Pretrain a BERT model with megatron-core and megatron-bitpipe (no Megatron-LM checkout needed).

    torchrun --nproc-per-node 4 scripts/pretrain_bert.py --pipeline-schedule bitpipe \\
        --pipeline-model-parallel-size 4 --num-layers 8 --hidden-size 64 \\
        --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 --global-batch-size 16 \\
        --train-iters 20 --lr 1e-3 --vocab-size 1000

Megatron-LM's flag names (BERT's: ``--bert-no-binary-head``, ``--mask-prob``,
``--short-seq-prob``); ``--help`` lists them and docs/running.md explains them. Without a GPU
it trains on the CPU (gloo) through megatron-bitpipe's CPU compatibility layer.
"""

import sys
import warnings

# megatron-core warns about every optional kernel library it does not find (apex, Transformer
# Engine), on every rank; the script's own log says what runs.
warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* (is|are) not installed", category=UserWarning)

from megatron_bitpipe.training import main  # noqa: E402
from megatron_bitpipe.training.bert import BertTask  # noqa: E402


def cpu_fallback() -> None:
    """No GPU: run megatron-core on the CPU with gloo (megatron_bitpipe.cpu)."""
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    enable_cpu_megatron()


if __name__ == "__main__":
    sys.exit(main(BertTask(), cpu_fallback=cpu_fallback))
