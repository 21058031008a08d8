#!/usr/bin/env python
"""Count the collectives each rank issues while it runs a training script.

Usage, under the launcher the script needs (the arguments after the script are its own)::

    torchrun --nproc-per-node 4 scripts/count_collectives.py --out DIR \\
        scripts/pretrain_gpt.py --tensor-parallel-mode optimus2d ...

Each rank writes ``DIR/rank<r>.json``: ``{collective: calls}`` over the whole run, set-up
included, as :class:`megatron_bitpipe.benchmarking.meters.CollectiveMeter` records them
(torch.distributed's collectives and the aliases megatron-core binds at import; a collective
that calls another counts once). Per iteration: the difference between two runs with
different ``--train-iters`` (and ``--eval-iters 0``), divided by the difference in iterations.
Point-to-point sends and receives are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from collections import Counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for rank<r>.json")
    parser.add_argument("script", help="the training script to run")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args()

    from megatron_bitpipe.benchmarking.meters import CollectiveMeter

    meter = CollectiveMeter()
    sys.argv = [args.script] + args.script_args
    code = 0
    with meter:
        try:
            runpy.run_path(args.script, run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code or 0
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"rank{os.environ.get('RANK', '0')}.json")
    with open(path, "w", encoding="utf-8") as out:
        json.dump(dict(sorted(Counter(call.op for call in meter.calls).items())), out)
    sys.exit(code)


if __name__ == "__main__":
    main()
