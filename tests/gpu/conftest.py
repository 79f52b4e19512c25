"""GPU tests run on a leased machine whose console output is all that comes back: an internal error of a CLI run
inside a test prints its traceback (H3_DEBUG=1), not only the one-line summary."""

import pytest


@pytest.fixture(autouse=True)
def _tracebacks_of_internal_errors(monkeypatch):
    monkeypatch.setenv("H3_DEBUG", "1")
