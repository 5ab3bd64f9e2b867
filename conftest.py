"""For ``pytest --doctest-modules bridgeflow adapters``: each module's examples run in a temporary directory,
as in tests/test_doctests.py (the suite's runner), so examples that save files leave nothing behind."""

from __future__ import annotations

import pytest
from _pytest.doctest import DoctestItem


@pytest.fixture(autouse=True)
def _doctest_in_tmp_path(request):
    if isinstance(request.node, DoctestItem):  # other tests are left as they are (no tmp_path made for them)
        request.getfixturevalue("monkeypatch").chdir(request.getfixturevalue("tmp_path"))
