"""The ``strict_p2p`` marker on a single test (``tests/conftest.py``): its body runs with
``MEGATRON_BITPIPE_STRICT_P2P=1``, the module's other tests without it; a value the
environment sets wins."""

from __future__ import annotations

import os

import pytest

ENV = "MEGATRON_BITPIPE_STRICT_P2P"
#: the environment's own value, read at collection (before any fixture)
FROM_ENVIRONMENT = os.environ.get(ENV)


@pytest.mark.strict_p2p
@pytest.mark.parametrize("case", ["first", "second"])
def test_a_marked_test_runs_in_strict_mode(case):
    assert os.environ.get(ENV) == (FROM_ENVIRONMENT if FROM_ENVIRONMENT is not None else "1")


def test_an_unmarked_test_of_the_module_does_not():
    assert os.environ.get(ENV) == FROM_ENVIRONMENT
