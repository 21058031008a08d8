"""Choose a CRAIG weighted coreset of a GPT run's training samples (docs/coresets.md).

    python scripts/select_coreset.py --num-layers 2 --hidden-size 64 --num-attention-heads 4 \\
        --seq-length 64 --micro-batch-size 16 --global-batch-size 16 --train-iters 150 --lr 3e-3 \\
        --data-path data/stdlib_docs_text_document --split 90,10,0 \\
        --tokenizer-type ByteLevelTokenizer --vocab-size 256 \\
        --fraction 0.25 --coreset-warmup-iters 20 --output data/coreset.npz
    python scripts/pretrain_gpt.py [the same flags, without the selection's] --coreset data/coreset.npz

The pretrain script's flags (``--help`` lists them) plus ``--fraction``, ``--output``,
``--coreset-method``, ``--coreset-warmup-iters`` and ``--coreset-shard-size``; one process.
"""

import sys

from megatron_bitpipe.training.script import ignore_dependency_warnings

ignore_dependency_warnings()


def cpu_fallback():
    """No GPU: megatron-core on the CPU (megatron_bitpipe.cpu)."""
    from megatron_bitpipe.cpu.compat import enable_cpu_megatron

    return enable_cpu_megatron()


if __name__ == "__main__":
    from megatron_bitpipe.training.coreset.select import main

    sys.exit(main(cpu_fallback=cpu_fallback))
