"""The patch route: ``patches/megatron-lm-core_v0.16.1.patch`` and ``scripts/apply_megatron_patch.py``.

Without a checkout: the patch touches only Megatron-LM's training code and only calls the
plugin; the script refuses a checkout of the wrong version (exit 2) and one whose files differ
(exit 1). With ``MEGATRON_LM_PATH`` (tag core_v0.16.1): on a copy of the files it patches, the
script checks, applies, is idempotent, and reverts to the original bytes. (Training through a
patched checkout: tests/test_megatron_lm_training.py.)
"""

from __future__ import annotations

import pytest

import re
import shutil
import subprocess
import sys

from .megatron_lm_support import REPO, checkout_or_skip, fake_checkout

PATCH = REPO / "patches" / "megatron-lm-core_v0.16.1.patch"
SCRIPT = REPO / "scripts" / "apply_megatron_patch.py"
PATCHED_FILES = ["megatron/training/arguments.py", "megatron/training/training.py", "megatron/training/utils.py"]


def apply_script(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, argv)], capture_output=True, text=True, timeout=120)


def test_patch_is_small_and_only_calls_the_plugin():
    text = PATCH.read_text()
    assert re.findall(r"^diff --git a/(\S+) b/", text, re.M) == PATCHED_FILES
    added = [line[1:] for line in text.splitlines() if line.startswith("+") and not line.startswith("+++")]
    assert len(added) <= 40
    imports = [line.strip() for line in added if "import" in line]
    assert imports and all(line.startswith("from megatron_bitpipe.megatron_lm.") for line in imports)


@pytest.mark.multirank
def test_script_refuses_a_checkout_of_another_version(tmp_path):
    root = fake_checkout(tmp_path / "Megatron-LM", version=(0, 15, 0))
    result = apply_script(root)
    assert result.returncode == 2
    assert f"{root.resolve()} is megatron-core 0.15.0" in result.stderr and "core_v0.16.1" in result.stderr


@pytest.mark.multirank
def test_script_refuses_changed_files(tmp_path):
    root = fake_checkout(tmp_path / "Megatron-LM")
    for name in PATCHED_FILES:
        (root / name).write_text("# not Megatron-LM's file\n")
    for flags in ([], ["--check"]):
        result = apply_script(root, *flags)
        assert result.returncode == 1 and "does not apply" in result.stderr and "core_v0.16.1" in result.stderr
    assert all((root / name).read_text() == "# not Megatron-LM's file\n" for name in PATCHED_FILES)


def test_script_applies_checks_and_reverts(tmp_path):
    checkout = checkout_or_skip()
    copy = tmp_path / "Megatron-LM"
    for name in [*PATCHED_FILES, "megatron/core/package_info.py"]:
        (copy / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(checkout / name, copy / name)
    original = {name: (copy / name).read_bytes() for name in PATCHED_FILES}

    check = apply_script(copy, "--check")
    assert check.returncode == 0 and "applies cleanly" in check.stdout, check.stderr
    assert {name: (copy / name).read_bytes() for name in PATCHED_FILES} == original
    assert apply_script(copy).returncode == 0
    assert "MEGATRON_BITPIPE_PATCHED = True" in (copy / "megatron/training/training.py").read_text()
    for flags in ([], ["--check"]):
        again = apply_script(copy, *flags)
        assert again.returncode == 0 and "already applied" in again.stdout
    assert apply_script(copy, "--revert").returncode == 0
    assert {name: (copy / name).read_bytes() for name in PATCHED_FILES} == original
