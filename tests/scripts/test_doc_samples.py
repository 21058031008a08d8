"""The sample outputs and measured numbers README.md and docs/ quote come from
``scripts/doc_samples.py``: every block is there with the commands it was made from and a stamp
saying how it was made, and the fast samples still print what the documents show."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))
import doc_samples  # noqa: E402


def _rendered_blocks():
    """(sample, document, block) of every block a sample run writes."""
    return [
        ("quick-start", "docs/running.md", "quick-start-output"),
        ("bert", "docs/running.md", "bert-output"),
        ("real-text", "README.md", "real-text"),
        ("real-text", "docs/running.md", "real-text-output"),
        ("gpu-dry-run", "docs/gpu.md", "gpu-dry-run"),
    ]


@pytest.mark.parametrize("sample,path,block", _rendered_blocks())
def test_every_block_is_there_and_says_how_it_was_made(sample, path, block):
    text = doc_samples.documented_block(path, block)
    stamps = [line for line in text.splitlines() if line.startswith(doc_samples.STAMP_PREFIX)]
    assert len(stamps) == 1 and stamps[0].startswith(f"(`python scripts/doc_samples.py {sample}`, commit "), stamps
    assert " at a load average of " in stamps[0]


@pytest.mark.parametrize("block", ["results-bubble", "results-message-costs"])
def test_readmes_simulated_rows_say_how_they_were_made(block):
    text = doc_samples.documented_block("README.md", block)
    assert text.splitlines()[-1] == "(`python scripts/doc_samples.py readme-results`: simulated, the same on every machine)"


@pytest.mark.parametrize("sample", ["schedule-recommend", "schedule-list", "balanced-stages"])
def test_pure_samples_match_the_documents(sample):
    """The samples that are pure Python (no processes) print what the documents show."""
    for (path, block), fresh in doc_samples.SAMPLES[sample].blocks(check=True).items():
        assert doc_samples.differences(doc_samples.documented_block(path, block), fresh) == [], (path, block)


def test_the_commands_shown_are_the_commands_run():
    readme, running = (REPO / "README.md").read_text(), (REPO / "docs/running.md").read_text()
    assert doc_samples.QUICK_START.one_line() in readme
    assert doc_samples.QUICK_START.multi_line() in running
    assert doc_samples.BERT.multi_line() in running
    for command in (doc_samples.PREPROCESS, doc_samples.REAL_TEXT):
        assert command.one_line() in doc_samples.documented_block("README.md", "real-text")
        assert command.multi_line() in doc_samples.documented_block("docs/running.md", "real-text-output")
    assert "real-text" in doc_samples.documented_block("docs/running.md", "real-text-same-math")


def test_what_differs_from_run_to_run_is_not_compared():
    documented = (
        " [2026-11-27 04:18:20.419787] iteration        2/      20 | elapsed time per iteration (ms): 512.3 | "
        "tokens per second: 2004.8 | lm loss: 5.959843E+00 | grad norm: 1.154 | max memory (MiB): 396.2 |\n"
        "(`python scripts/doc_samples.py quick-start`, commit abc, 2026-11-27: 42 s on 2 CPU cores at a load average of 3)"
    )
    rerun = (
        " [2027-01-01 00:00:00.000001] iteration        2/      20 | elapsed time per iteration (ms): 99.0 | "
        "tokens per second: 9.5 | lm loss: 5.959844E+00 | grad norm: 1.155 | max memory (MiB): 1.0 |"
    )
    assert doc_samples.differences(documented, rerun) == []
    assert doc_samples.differences(documented, rerun.replace("5.959844E+00", "5.969843E+00"))  # the loss changed
    assert doc_samples.differences(documented, rerun.replace("grad norm", "gradient norm"))  # the text changed
    assert doc_samples.differences(documented, rerun + "\nmore")  # a line more


@pytest.mark.multirank
def test_fast_samples_match_the_documents():
    """``scripts/doc_samples.py --check``: the fast samples (docs/running.md's quick start, 4
    ranks; README's simulated rows) rerun and compared; ``python scripts/doc_samples.py NAME``
    regenerates one."""
    result = subprocess.run([sys.executable, "scripts/doc_samples.py", "--check"], cwd=REPO, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]


def _documents():
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@pytest.mark.parametrize("document", _documents(), ids=lambda path: path.name)
def test_documents_stand_on_their_own(document):
    """Every relative link of README.md and docs/ names a file of the checkout, and no page
    sends the reader to a design document that is not in it."""
    import re

    text = document.read_text(encoding="utf-8")
    assert "DESIGN" not in text
    for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path = (document.parent / target).resolve()
        assert path.is_relative_to(REPO) and path.exists(), f"{document.name}: link to {target}"


def test_scripts_and_package_name_no_outside_design_document():
    sources = [*(REPO / "scripts").glob("*.py"), *(REPO / "megatron_bitpipe").rglob("*.py")]
    assert [path.name for path in sources if "DESIGN" in path.read_text(encoding="utf-8")] == []


def test_the_fast_loop_leaves_out_processes_and_the_plan_sweep_which_ci_runs_once():
    """README's fast loop deselects ``multirank`` and ``plan_sweep``, the sweep has its own
    command, and CI runs the sweep once: in README's whole-suite command (two runs whose
    marker selections, ``not multirank`` and ``multirank``, together take every test once),
    not again in the megatron-core 0.19 pass."""
    import re

    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert 'python -m pytest -m "not multirank and not plan_sweep" tests' in readme
    assert "python -m pytest -m plan_sweep tests" in readme
    whole = readme.split("<!-- ci:test-command -->", 1)[1].split("```", 2)[1]
    selections = [re.search(r' -m "?([a-z_ ]+?)"? tests', run).group(1) for run in whole.split("python -m pytest")[1:]]
    assert selections == ["not multirank", "multirank"], whole
    ci = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    pytest_runs = re.findall(r"^python -m pytest .*$", ci, re.M)
    assert pytest_runs and all("not plan_sweep" in run or "MCORE019_MULTIRANK" in run for run in pytest_runs), pytest_runs
