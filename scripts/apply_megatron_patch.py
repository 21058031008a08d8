#!/usr/bin/env python
"""Apply (or check, or revert) megatron-bitpipe's patch to a Megatron-LM checkout.

    python scripts/apply_megatron_patch.py [CHECKOUT] [--check | --revert]

CHECKOUT defaults to ``$MEGATRON_LM_PATH``. The checkout must be tag core_v0.16.1 (its
``megatron/core/package_info.py`` says 0.16.1). The patch is
``patches/megatron-lm-core_v0.16.1.patch`` next to this script's directory; ``git apply``
does the work (the checkout need not be a git repository).

* default: apply it; a checkout that already carries it is left as it is (idempotent);
* ``--check``: change nothing, say whether the patch is applied or applies cleanly;
* ``--revert``: remove it again.

Exit status: 0 done (or nothing to do), 1 the patch does not apply to this checkout (files
changed locally), 2 no usable checkout or bad arguments. Messages name the checkout, the
expected tag and ``MEGATRON_LM_PATH``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PATCH = REPO / "patches" / "megatron-lm-core_v0.16.1.patch"
sys.path.insert(0, str(REPO))

from megatron_bitpipe.megatron_lm.checkout import (  # noqa: E402 (after the path set-up)
    ENV_VAR,
    SUPPORTED_TAG,
    MegatronLMCheckoutError,
    find_checkout,
)


def _git_apply(root: Path, *flags: str) -> subprocess.CompletedProcess:
    """``git apply FLAGS PATCH`` run in ``root``; git looks for no repository above ``root``."""
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(root.parent))
    return subprocess.run(["git", "apply", *flags, str(PATCH)], cwd=root, env=env, capture_output=True, text=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", nargs="?", default=os.environ.get(ENV_VAR), help=f"Megatron-LM checkout (default: ${ENV_VAR})")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="only check; change nothing")
    mode.add_argument("--revert", action="store_true", help="remove the patch")
    args = parser.parse_args(argv)
    if not args.checkout:
        parser.error(f"give the Megatron-LM checkout (tag {SUPPORTED_TAG}) or set {ENV_VAR}")
    try:
        root = find_checkout(Path(args.checkout)).root
    except MegatronLMCheckoutError as error:
        print(f"apply_megatron_patch: error: {error}", file=sys.stderr)
        return 2

    applied = _git_apply(root, "--reverse", "--check").returncode == 0
    if applied and not args.revert:
        print(f"{root}: the megatron-bitpipe patch is already applied")
        return 0
    if not applied and args.revert:
        print(f"{root}: the megatron-bitpipe patch is not applied; nothing to revert")
        return 0
    check = _git_apply(root, "--check", *(["--reverse"] if args.revert else []))
    if check.returncode != 0:
        print(
            f"apply_megatron_patch: error: {PATCH.name} does not apply to {root} (files changed since tag "
            f"{SUPPORTED_TAG}?):\n{check.stderr.strip()}",
            file=sys.stderr,
        )
        return 1
    if args.check:
        print(f"{root}: the megatron-bitpipe patch applies cleanly (not applied yet)")
        return 0
    result = _git_apply(root, *(["--reverse"] if args.revert else []))
    if result.returncode != 0:
        print(f"apply_megatron_patch: error: git apply failed in {root}:\n{result.stderr.strip()}", file=sys.stderr)
        return 1
    print(f"{root}: megatron-bitpipe patch {'reverted' if args.revert else 'applied'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
