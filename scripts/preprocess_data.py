"""Tokenize text or JSON lines into Megatron indexed datasets (``.bin``/``.idx``) for
``--data-path``, with megatron-core's tokenizers and dataset builder.

    python scripts/preprocess_data.py --input stdlib-docs --output-prefix data/stdlib_docs \\
        --tokenizer-type ByteLevelTokenizer --append-eod

writes ``data/stdlib_docs_text_document.bin`` and ``.idx`` from the documentation Python ships
(no download). Megatron-LM's ``tools/preprocess_data.py`` flag names; ``--help`` lists them,
docs/running.md explains them, :mod:`megatron_bitpipe.training.preprocess` is the code.
"""

import sys

from megatron_bitpipe.training.script import ignore_dependency_warnings

ignore_dependency_warnings()  # megatron-core's notes on apex / Transformer Engine, every rank

from megatron_bitpipe.training.preprocess import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
