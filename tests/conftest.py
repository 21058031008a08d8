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
  rank; each world size is launched once, when a test first needs it, with the cases the
  session's selected tests need (all of them when the whole module runs; ``-k`` on a case's
  id launches that case alone);
* ``references`` — :class:`References`, ``{reference_key: record}`` for those cases, one launch.

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
from collections.abc import Mapping
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


def _wanted(request, fixture: str, cases) -> list:
    """The module's ``cases`` that this session's selected tests need through ``fixture``: the
    ``case`` parameter of each selected test that takes the fixture, and every case when a
    selected test takes it without one (it may ask for any case). In CASES order."""
    module = request.module
    names, everything = set(), False
    for item in request.session.items:
        if getattr(item, "module", None) is not module or fixture not in getattr(item, "fixturenames", ()):
            continue
        case = getattr(getattr(item, "callspec", None), "params", {}).get("case")
        if case is None or not hasattr(case, "name"):
            everything = True
            break
        names.add(case.name)
    return list(cases) if everything else [c for c in cases if c.name in names]


class LaunchedCases:
    """The per-rank records of a module's multi-rank cases, one launch per world size.

    ``self[case]`` launches ``case.world_size`` ranks running ``run_cases`` on the cases of that
    world size the session's selected tests need (:func:`_wanted`: all of them when the whole
    module runs) and returns ``case``'s entry from every rank, by rank; later lookups reuse the
    records, and a case outside the first launch (a test asking for one it was not
    parametrized with) gets a launch of its own. :meth:`ranks` gives the whole per-rank outputs
    of a world size's launches, merged.
    """

    def __init__(self, run_cases, cases, wanted, timeout: float):
        self._run_cases = run_cases
        self._cases = list(cases)
        self._wanted = list(wanted)
        self._timeout = timeout
        self._outputs: Dict[int, List[dict]] = {}
        self._launched: set = set()

    def _launch(self, world_size: int, extra=()) -> None:
        cases = [c for c in self._wanted + list(extra) if c.world_size == world_size and c.name not in self._launched]
        cases = list({c.name: c for c in cases}.values())
        if not cases:
            if world_size in self._outputs:
                return
            cases = [c for c in self._cases if c.world_size == world_size]
            if not cases:
                raise KeyError(f"no case of world size {world_size}")
        outputs = launch(self._run_cases, world_size, cases, timeout=self._timeout)
        self._launched.update(c.name for c in cases)
        merged = self._outputs.setdefault(world_size, [{} for _ in outputs])
        for into, output in zip(merged, outputs):
            into.update(output)

    def ranks(self, world_size: int) -> List[dict]:
        if world_size not in self._outputs:
            self._launch(world_size)
        return self._outputs[world_size]

    def __getitem__(self, case) -> List[dict]:
        if case.name not in self._launched:
            self._launch(case.world_size, [case])
        return [output[case.name] for output in self._outputs[case.world_size]]


class References(Mapping):
    """``{reference_key: record}``: the single-process records of a module's cases, from one
    rank running ``run_references`` on the keys of the cases the session's selected tests need
    (:func:`_wanted`), launched at the first lookup; a key outside them gets a launch of its own.
    Iterating (``values()``, ``items()``) gives those keys' records."""

    def __init__(self, run_references, keys, timeout: float):
        self._run_references = run_references
        self._keys = sorted(set(keys))
        self._timeout = timeout
        self._records: dict = {}

    def _load(self, extra=()) -> None:
        keys = [k for k in self._keys if k not in self._records]
        keys += [k for k in extra if k not in self._records and k not in keys]
        if keys:
            self._records.update(launch(self._run_references, 1, keys, timeout=self._timeout)[0])

    def __getitem__(self, key):
        if key not in self._records:
            self._load([key])
        return self._records[key]

    def __iter__(self):
        self._load()
        return iter(self._records)

    def __len__(self) -> int:
        self._load()
        return len(self._records)


def _launch_timeout(module) -> float:
    return getattr(module, "LAUNCH_TIMEOUT", DEFAULT_LAUNCH_TIMEOUT)


@pytest.fixture(scope="module")
def launched(request) -> LaunchedCases:
    module = request.module
    return LaunchedCases(module.run_cases, module.CASES, _wanted(request, "launched", module.CASES), _launch_timeout(module))


@pytest.fixture(scope="module")
def references(request) -> References:
    module = request.module
    keys = {case.reference_key for case in _wanted(request, "references", module.CASES)}
    return References(module.run_references, keys, _launch_timeout(module))
