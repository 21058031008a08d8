#!/usr/bin/env python
"""Apply (or check, or revert) megatron-bitpipe's patch to a Megatron-LM checkout.

    python scripts/apply_megatron_patch.py [CHECKOUT] [--check | --revert]

CHECKOUT defaults to ``$MEGATRON_LM_PATH``. There is one patch per tested Megatron-LM tag,
``patches/megatron-lm-<tag>.patch`` (core_v0.16.1, core_v0.19.0); the checkout's
``megatron/core/package_info.py`` tells which tag it is. A checkout of another version gets
one warning line and the patch of the nearest tested version (then the others): the first
that applies is used, and the checkout is refused only if none does. ``git apply`` does the
work (the checkout need not be a git repository).

* default: apply it; a checkout that already carries a patch is left as it is (idempotent);
* ``--check``: change nothing, say whether a patch is applied or applies cleanly;
* ``--revert``: remove it again.

Exit status: 0 done (or nothing to do), 1 no patch applies to this checkout (files changed
locally, or a Megatron-LM version too far from the tested tags), 2 no usable checkout or bad
arguments. Messages name the checkout, the tested tags and ``MEGATRON_LM_PATH``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import List

REPO = Path(__file__).resolve().parent.parent
PATCHES = REPO / "patches"
sys.path.insert(0, str(REPO))

from megatron_bitpipe.megatron_lm.checkout import (  # noqa: E402 (after the path set-up)
    ENV_VAR,
    TESTED_TAGS,
    Checkout,
    MegatronLMCheckoutError,
    find_checkout,
    tested_tags_text,
    untested_warning,
    version_tuple,
)


def patch_of(tag: str) -> Path:
    return PATCHES / f"megatron-lm-{tag}.patch"


def candidate_patches(checkout: Checkout) -> List[Path]:
    """The patches to try on ``checkout``: its tag's; for another version every tested tag's,
    the nearest release first."""
    if checkout.tag is not None:
        return [patch_of(checkout.tag)]

    def release(version: str) -> float:
        major, minor, patch = (version_tuple(version) + (0, 0, 0))[:3]
        return major * 1000 + minor + patch / 1000

    mine = release(checkout.version)
    return [patch_of(tag) for tag in sorted(TESTED_TAGS, key=lambda tag: abs(release(TESTED_TAGS[tag]) - mine))]


def _git_apply(root: Path, patch: Path, *flags: str) -> subprocess.CompletedProcess:
    """``git apply FLAGS PATCH`` run in ``root``; git looks for no repository above ``root``."""
    env = dict(os.environ, GIT_CEILING_DIRECTORIES=str(root.parent))
    return subprocess.run(["git", "apply", *flags, str(patch)], cwd=root, env=env, capture_output=True, text=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", nargs="?", default=os.environ.get(ENV_VAR), help=f"Megatron-LM checkout (default: ${ENV_VAR})")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="only check; change nothing")
    mode.add_argument("--revert", action="store_true", help="remove the patch")
    args = parser.parse_args(argv)
    if not args.checkout:
        parser.error(f"give the Megatron-LM checkout (tag {tested_tags_text()}) or set {ENV_VAR}")
    try:
        checkout = find_checkout(Path(args.checkout))
    except MegatronLMCheckoutError as error:
        print(f"apply_megatron_patch: error: {error}", file=sys.stderr)
        return 2
    root = checkout.root
    warning = untested_warning(checkout)
    if warning is not None:
        print(f"apply_megatron_patch: warning: {warning}", file=sys.stderr)
    patches = candidate_patches(checkout)

    applied = next((patch for patch in patches if _git_apply(root, patch, "--reverse", "--check").returncode == 0), None)
    if applied is not None and not args.revert:
        print(f"{root}: the megatron-bitpipe patch is already applied ({applied.name})")
        return 0
    if applied is None and args.revert:
        print(f"{root}: the megatron-bitpipe patch is not applied; nothing to revert")
        return 0
    if args.revert:
        patch = applied
    else:
        failures = {}
        for candidate in patches:
            check = _git_apply(root, candidate, "--check")
            if check.returncode == 0:
                patch = candidate
                break
            failures[candidate.name] = check.stderr.strip()
        else:
            reasons = "\n".join(f"{name}:\n{reason}" for name, reason in failures.items())
            print(
                f"apply_megatron_patch: error: no megatron-bitpipe patch applies to {root} (megatron-core "
                f"{checkout.version}; files changed since tag {checkout.tag or tested_tags_text()}?):\n{reasons}",
                file=sys.stderr,
            )
            return 1
    if args.check:
        print(f"{root}: the megatron-bitpipe patch applies cleanly ({patch.name}, not applied yet)")
        return 0
    result = _git_apply(root, patch, *(["--reverse"] if args.revert else []))
    if result.returncode != 0:
        print(f"apply_megatron_patch: error: git apply failed in {root}:\n{result.stderr.strip()}", file=sys.stderr)
        return 1
    print(f"{root}: megatron-bitpipe patch {'reverted' if args.revert else 'applied'} ({patch.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
