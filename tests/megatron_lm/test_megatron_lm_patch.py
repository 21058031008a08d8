"""The patch route: ``patches/megatron-lm-<tag>.patch`` and ``scripts/apply_megatron_patch.py``.

Without a checkout: each tested tag has a patch, touching only Megatron-LM's training code
(and, at core_v0.19.0, megatron-core's batch broadcast in the checkout) and only calling the
plugin; the script warns about a checkout of another version and tries the nearest tag's patch
first, refusing (exit 1) only when no patch applies, and refuses a checkout whose files differ
(exit 1). With ``MEGATRON_LM_PATH`` (a tested tag): on a copy of the files it patches, the
script checks, applies, is idempotent, and reverts to the original bytes. (Training through a
patched checkout: tests/megatron_lm/test_megatron_lm_training.py.)
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from megatron_bitpipe.megatron_lm.checkout import TESTED_TAGS, find_checkout

from .megatron_lm_support import REPO, checkout_or_skip, fake_checkout

SCRIPT = REPO / "scripts" / "apply_megatron_patch.py"
PATCHED_FILES = {
    "core_v0.16.1": ["megatron/training/arguments.py", "megatron/training/training.py", "megatron/training/utils.py"],
    "core_v0.19.0": ["megatron/core/utils.py", "megatron/training/arguments.py", "megatron/training/training.py"],
}


def apply_script(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, argv)], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("tag", list(TESTED_TAGS))
def test_patch_is_small_and_only_calls_the_plugin(tag):
    text = (REPO / "patches" / f"megatron-lm-{tag}.patch").read_text()
    assert text.startswith(f"megatron-bitpipe for Megatron-LM tag {tag} (the patch route).")
    assert re.findall(r"^diff --git a/(\S+) b/", text, re.M) == PATCHED_FILES[tag]
    diff = text[text.index("diff --git"):].splitlines()
    added = [line[1:] for line in diff if line.startswith("+") and not line.startswith("+++")]
    assert len(added) <= 40
    imports = [line.strip() for line in added if "import" in line]
    assert imports and all(line.startswith("from megatron_bitpipe.megatron_lm.") for line in imports)
    removed = [line for line in diff if line.startswith("-") and not line.startswith("---")]
    assert len(removed) <= 2  # a renamed function or a redirected call, nothing deleted


@pytest.mark.multirank
def test_script_warns_about_another_version_and_refuses_when_no_patch_applies(tmp_path):
    root = fake_checkout(tmp_path / "Megatron-LM", version=(0, 18, 2))
    result = apply_script(root)
    assert result.returncode == 1
    assert f"warning: the Megatron-LM checkout {root.resolve()} is megatron-core 0.18.2" in result.stderr
    assert "no megatron-bitpipe patch applies" in result.stderr
    # the nearest tested release's patch is tried first
    assert result.stderr.index("megatron-lm-core_v0.19.0.patch") < result.stderr.index("megatron-lm-core_v0.16.1.patch")


@pytest.mark.multirank
@pytest.mark.parametrize("tag", list(TESTED_TAGS))
def test_script_refuses_changed_files(tmp_path, tag):
    major, minor, patch = map(int, TESTED_TAGS[tag].split("."))
    root = fake_checkout(tmp_path / "Megatron-LM", version=(major, minor, patch))
    for name in PATCHED_FILES[tag]:
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("# not Megatron-LM's file\n")
    for flags in ([], ["--check"]):
        result = apply_script(root, *flags)
        assert result.returncode == 1 and "no megatron-bitpipe patch applies" in result.stderr and tag in result.stderr
        assert "warning" not in result.stderr
    assert all((root / name).read_text() == "# not Megatron-LM's file\n" for name in PATCHED_FILES[tag])


@pytest.mark.multirank
def test_script_applies_checks_and_reverts(tmp_path):
    checkout = checkout_or_skip()
    tag = find_checkout(checkout).tag
    assert tag is not None, f"{checkout} is not a tested Megatron-LM tag"
    copy = tmp_path / "Megatron-LM"
    for name in [*PATCHED_FILES[tag], "megatron/core/package_info.py"]:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(checkout / name, copy / name)
    (copy / "megatron" / "training" / "__init__.py").touch()
    original = {name: (copy / name).read_bytes() for name in PATCHED_FILES[tag]}

    check = apply_script(copy, "--check")
    assert check.returncode == 0 and "applies cleanly" in check.stdout and tag in check.stdout, check.stderr
    assert {name: (copy / name).read_bytes() for name in PATCHED_FILES[tag]} == original
    assert apply_script(copy).returncode == 0
    assert "MEGATRON_BITPIPE_PATCHED = True" in (copy / "megatron/training/training.py").read_text()
    for flags in ([], ["--check"]):
        again = apply_script(copy, *flags)
        assert again.returncode == 0 and "already applied" in again.stdout
    assert apply_script(copy, "--revert").returncode == 0
    assert {name: (copy / name).read_bytes() for name in PATCHED_FILES[tag]} == original
