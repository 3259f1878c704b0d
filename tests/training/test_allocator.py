"""keep_freed_memory: a large freed block is reused without new page faults, the user's own
allocator settings win, and training on CPU sets it. Each case that sets it runs in a fresh
process, since the setting is process-wide."""

import os
import platform
import subprocess
import sys

import pytest

from octlm.training import loop
from octlm.training.allocator import keep_freed_memory
from tests.training_helpers import configs, write_corpus

glibc_only = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="mallopt's thresholds are glibc's",
)

# Allocates, fills and frees a 64 MiB tensor 24 times; prints the setting's result and the
# minor page faults of the last eight rounds (a fresh mapping faults once per page it touches).
# The first rounds may still grow the heap while freed blocks settle into reusable places.
_FAULTS = """
import resource, sys, torch
from octlm.training.allocator import keep_freed_memory
kept = keep_freed_memory() if sys.argv[1] == "keep" else None
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(16):
    torch.empty(1 << 24).fill_(1.0)  # 64 MiB, freed at once
before = faults()
for _ in range(8):
    torch.empty(1 << 24).fill_(1.0)
print(kept, faults() - before)
"""


def _run(arm: str, **env: str) -> tuple[str, int]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_"))}
    done = subprocess.run(
        [sys.executable, "-c", _FAULTS, arm],
        capture_output=True, text=True, check=True, env=environment | env,
    )  # fmt: skip
    kept, faults = done.stdout.split()
    return kept, int(faults)


@glibc_only
def test_a_freed_large_block_is_reused_without_page_faults():
    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")  # of one 64 MiB block
    kept, faults = _run("keep")
    assert kept == "True"
    _, faults_by_default = _run("default")
    assert faults_by_default > 6 * pages  # the premise: by default each round maps it anew
    assert faults < 2 * pages  # kept in the heap: a settled round seldom touches a new block


@glibc_only
@pytest.mark.parametrize("name", ["MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"])
def test_the_users_own_allocator_settings_are_kept(name, monkeypatch):
    """With the user's setting in the environment it sets nothing and says so; setting
    nothing, it can be asked in this process."""
    for other in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"):
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, "glibc.malloc.check=0" if name == "GLIBC_TUNABLES" else "131072")
    assert keep_freed_memory() is False


def test_training_on_cpu_keeps_freed_memory(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(loop, "keep_freed_memory", lambda: calls.append(True) or True)
    model_config, run = configs(write_corpus(tmp_path / "corpus"), steps=1)
    loop.train(model_config, run, tmp_path / "run", progress=False)
    assert calls == [True]
