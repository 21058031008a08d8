"""Shared pytest configuration: the ``multirank`` marker (tests that start processes;
``pytest -m "not multirank"`` is the fast loop)."""


def pytest_configure(config):
    config.addinivalue_line("markers", "multirank: the test starts processes (ranks or workers)")
