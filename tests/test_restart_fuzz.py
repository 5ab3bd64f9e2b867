"""The restart fuzz (``tests/fuzz/fuzz_restart.py``) on a few of its runs: a random worker SIGKILLed at random
moments of a process map stage (ordered, and unordered, with batches stacked in the workers), a runner and the
torch DataLoader at 2 workers, each compared with its undisturbed run. The big run (200 runs) is the script's."""

from __future__ import annotations

import os
import sys

import pytest

from conftest import need

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz"))

import fuzz_restart


@pytest.mark.parametrize("index", range(8))
@pytest.mark.filterwarnings("ignore::bridgeflow.UnshardedWarning")
def test_workers_killed_at_random_moments_leave_the_epochs_as_promised(index):
    if fuzz_restart.draw(0, index)["kind"] == "loader":
        need("torch")
    result = fuzz_restart.check_run(0, index, timeout=None)  # the suite's hang guard ends a hang
    assert result["status"] == "ok", (result.get("why"), result)  # the cause first: pytest cuts long messages
    assert result["restarts"] <= result["kills"], result
