"""Shared fixtures and the ``multirank`` marker of the test suite.

**Markers.** Every test that starts a process — a launch on several gloo ranks
(:func:`megatron_bitpipe.cpu.launcher.launch`), ``torchrun``, a command-line run in a
subprocess — carries ``@pytest.mark.multirank`` (or a module-level ``pytestmark``), so
``python -m pytest -m "not multirank and not plan_sweep" tests`` is the fast, pure-Python
loop (``plan_sweep``: the pure-Python sweep of every generator's plans under NCCL's rules,
minutes on its own, run by ``-m plan_sweep``). The marker is enforced: a test without it that
starts a process, directly or through a fixture, fails naming the test.

**Multi-rank cases.** A test module that trains cases on CPU ranks defines

* ``CASES`` — its cases, each with ``name``, ``world_size`` and (for references)
  ``reference_key``;
* ``run_cases(cases) -> dict`` — module-level and picklable, run on every rank of one launch
  with the cases of that launch's world size; returns one entry per case name (and any
  per-launch extras under other keys);
* ``run_references(keys) -> dict`` — optional, run on one rank: the single-process record of
  every reference key;

and takes the fixtures

* ``launched`` — :class:`LaunchedCases`: ``launched[case]`` is ``case``'s record from every
  rank; each world size is launched once, when a test first needs it;
* ``references`` — ``{reference_key: record}`` for every case of the module, one launch.

**Strict p2p.** One way to ask for it: the ``strict_p2p`` marker. A module marked
``strict_p2p`` (``pytestmark``) runs with ``MEGATRON_BITPIPE_STRICT_P2P=1``: its ranks' gloo
point-to-point communication follows NCCL's rules (:mod:`megatron_bitpipe.cpu.strict_p2p`), so
an order that would hang on GPUs fails there. A test marked ``strict_p2p`` in an unmarked
module runs its body with it (a module-scoped fixture it takes is set up before, without it:
mark the module when such a fixture launches). The launcher passes the variable on; setting
it in the environment (``=0`` too) overrides this.
"""

from __future__ import annotations

import multiprocessing.process
import os
import subprocess
from typing import Dict, List

import pytest

from megatron_bitpipe.cpu.launcher import launch

#: seconds one launch of a world size may take (a module may set ``LAUNCH_TIMEOUT``)
DEFAULT_LAUNCH_TIMEOUT = 900
_STRICT_P2P_ENV = "MEGATRON_BITPIPE_STRICT_P2P"


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers", "multirank: the test starts processes (gloo ranks, torchrun, a subprocess); deselect with -m 'not multirank'"
    )
    config.addinivalue_line(
        "markers",
        "plan_sweep: checks every generator's plans over a range of D and N; pure Python, independent of the "
        "megatron-core version (CI runs it once)",
    )
    config.addinivalue_line(
        "markers", "strict_p2p: the module's (or the test's) launches run with MEGATRON_BITPIPE_STRICT_P2P=1 (NCCL's p2p rules on gloo)"
    )


@pytest.fixture(scope="module", autouse=True)
def _strict_p2p_modules(request):
    """``MEGATRON_BITPIPE_STRICT_P2P=1`` while a module marked ``strict_p2p`` runs (unless the environment sets it)."""
    if request.node.get_closest_marker("strict_p2p") is None or _STRICT_P2P_ENV in os.environ:
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(_STRICT_P2P_ENV, "1")
        yield


@pytest.fixture(autouse=True)
def _strict_p2p_tests(request, monkeypatch):
    """``MEGATRON_BITPIPE_STRICT_P2P=1`` while a test marked ``strict_p2p`` runs (unless the
    environment, or its module's strictness, sets it already)."""
    if request.node.get_closest_marker("strict_p2p") is not None and _STRICT_P2P_ENV not in os.environ:
        monkeypatch.setenv(_STRICT_P2P_ENV, "1")


class _ProcessGuard:
    """While active, starting a process (multiprocessing or subprocess) raises, naming the test."""

    def __init__(self, nodeid: str):
        self.nodeid = nodeid
        self._saved = (multiprocessing.process.BaseProcess.start, subprocess.Popen)

    def _refuse(self, *args, **kwargs):
        raise RuntimeError(f"{self.nodeid} starts a process but is not marked multirank: add @pytest.mark.multirank")

    def __enter__(self) -> "_ProcessGuard":
        guard = self

        class Refused(subprocess.Popen):
            def __init__(self, *args, **kwargs):
                guard._refuse()

        multiprocessing.process.BaseProcess.start = lambda process: guard._refuse()
        subprocess.Popen = Refused
        return self

    def __exit__(self, *exc) -> None:
        multiprocessing.process.BaseProcess.start, subprocess.Popen = self._saved


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Guard every test without the ``multirank`` marker — its fixtures' setup included."""
    if item.get_closest_marker("multirank") is not None:
        yield
        return
    with _ProcessGuard(item.nodeid):
        yield


class LaunchedCases:
    """The per-rank records of a module's multi-rank cases, one launch per world size.

    ``self[case]`` launches ``case.world_size`` ranks running ``run_cases`` on every case of that
    world size (once; later lookups reuse the records) and returns ``case``'s entry from every
    rank, by rank. :meth:`ranks` gives the whole per-rank outputs of a world size's launch.
    """

    def __init__(self, run_cases, cases, timeout: float):
        self._run_cases = run_cases
        self._cases = list(cases)
        self._timeout = timeout
        self._outputs: Dict[int, List[dict]] = {}

    def ranks(self, world_size: int) -> List[dict]:
        if world_size not in self._outputs:
            cases = [c for c in self._cases if c.world_size == world_size]
            if not cases:
                raise KeyError(f"no case of world size {world_size}")
            self._outputs[world_size] = launch(self._run_cases, world_size, cases, timeout=self._timeout)
        return self._outputs[world_size]

    def __getitem__(self, case) -> List[dict]:
        return [output[case.name] for output in self.ranks(case.world_size)]


@pytest.fixture(scope="module")
def launched(request) -> LaunchedCases:
    module = request.module
    return LaunchedCases(module.run_cases, module.CASES, getattr(module, "LAUNCH_TIMEOUT", DEFAULT_LAUNCH_TIMEOUT))


@pytest.fixture(scope="module")
def references(request) -> dict:
    module = request.module
    keys = sorted({case.reference_key for case in module.CASES})
    return launch(module.run_references, 1, keys, timeout=getattr(module, "LAUNCH_TIMEOUT", DEFAULT_LAUNCH_TIMEOUT))[0]
