"""Fixtures shared by every test module (helpers live in tests/helpers.py and
tests/training_helpers.py)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from tests.training_helpers import write_corpus

# Runs report their share of a peak given here, not one measured on each test machine
# (tests/training/test_utilisation.py measures it).
os.environ.setdefault("OCTLM_PEAK_FLOPS", "1e11")


def pytest_configure(config):
    """Deliver Ctrl-C. A run started in the background of a non-interactive shell inherits
    SIGINT as ignored, and so would every process the tests spawn; the tests that press Ctrl-C
    on a run need it to arrive. A handler (unlike "ignored") is reset to the default in a
    spawned program, so its children get Python's own Ctrl-C handling too."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _one_intra_op_thread()


def _one_intra_op_thread() -> None:
    """The tests in this process run on one intra-op thread, whatever the machine's cores.
    pytest-xdist already runs more workers than cores, so a second thread per worker only
    spins and contends for the interpreter lock; results do not depend on the machine; and
    tests/attention/test_threads.py sets two threads where they are the point. Processes that the
    tests start keep torch's default."""
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def one_thread():
    """Small models and short sequences only pay for a second intra-op thread in
    synchronisation; modules of such tests run on one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def corpus(tmp_path) -> Path:
    """A folder of generated text files for octlm train (tests/training_helpers.py)."""
    return write_corpus(tmp_path / "corpus")
