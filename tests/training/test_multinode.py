"""octlm train on two torchrun "nodes": one torchrun per node (``--nnodes 2 --nproc-per-node 1``,
c10d rendezvous on localhost), as on two machines that share the run folder's storage, each
worker with LOCAL_RANK 0. One run folder goes through a time budget with evaluations, a signal
to one node and a resume to its last step; every launch must end on both nodes, and one that
hangs fails the test after :data:`TIMEOUT` seconds with both nodes' process groups killed.

A process group destroyed while DDP's reducer still holds it is destroyed without the GIL
released, and can wait for ever on a gloo thread that needs it: the run hangs at its end, now
and then (:func:`octlm.training.distributed.teardown`). A launch shows it only by chance, so
the spawned ranks below check what prevents it: no DDP wrapper outlives the run into the
teardown.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from octlm import load_run
from octlm.cli import main
from octlm.training import checkpoint, distributed, train
from octlm.training.metrics import METRICS
from tests.helpers import spawn
from tests.training.test_run_folder_lock import environment, wait_for
from tests.training_helpers import configs, losses, read_metrics, tiny_flags, write_corpus

pytestmark = pytest.mark.distributed

TIMEOUT = 120.0  # seconds for one launch of both nodes (each takes a few here)
FOREVER = 1_000_000  # steps of a run that only a time budget or a signal ends
STOPPED = re.compile(r"stopped by (SIGTERM|a signal on another rank) after step (\d+)")


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    """A token folder of byte tokens, prepared once, as both nodes' ``--data``."""
    root = tmp_path_factory.mktemp("multinode")
    corpus = write_corpus(root / "corpus")
    assert main(["prepare", "--data", str(corpus), "--out", str(root / "tokens"),
                 "--tokenizer", "bytes"]) == 0  # fmt: skip
    return root / "tokens"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


class Nodes:
    """Two torchrun processes, one per node, running ``octlm train`` on one run folder, their
    output in files. Each is in a session of its own, and starts its worker in another."""

    def __init__(self, label: str, tokens: Path, folder: Path, steps: int, *flags: str):
        rendezvous = [
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"localhost:{free_port()}",
        ]  # fmt: skip
        arguments = [*tiny_flags(tokens, folder, steps), "--no-compile", "--eval-every", "8"]
        command = [sys.executable, "-m", "torch.distributed.run", *rendezvous, "-m", "octlm"]
        self.logs = [folder.parent / f"{label}-node{node}" for node in range(2)]
        self.processes = [self._start([*command, *arguments, *flags], log) for log in self.logs]

    @staticmethod
    def _start(command: list[str], log: Path) -> subprocess.Popen:
        variables = {**environment(), "OMP_NUM_THREADS": "1"}  # one thread per worker
        with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
            return subprocess.Popen(
                command, env=variables, stdout=out, stderr=err, start_new_session=True
            )

    def output(self, node: int, stream: str = "out") -> str:
        return Path(f"{self.logs[node]}.{stream}").read_text(errors="replace")

    def main_output(self) -> str:
        """The standard output of the node whose worker is rank 0 (the rendezvous picks it)."""
        said = [self.output(node) for node in range(2)]
        speaking = [text for text in said if "run folder:" in text]
        assert len(speaking) == 1, said
        return speaking[0]

    def finish(self) -> list[int]:
        """Both torchruns' exit statuses, once both have ended; the test fails, with both
        nodes killed, if they have not after :data:`TIMEOUT` seconds."""
        deadline = time.monotonic() + TIMEOUT
        try:
            for process in self.processes:
                process.wait(timeout=max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            self.kill()
            tails = "\n".join(
                f"node {node} {stream}: {self.output(node, stream)[-1500:]}"
                for node in range(2)
                for stream in ("out", "err")
            )
            pytest.fail(f"the two nodes did not end in {TIMEOUT} s:\n{tails}")
        return [process.returncode for process in self.processes]

    def kill(self) -> None:
        """SIGKILL to both torchruns' sessions and to their workers' (sessions of their own)."""
        for process in self.processes:
            for pid in [process.pid, *_children(process.pid)]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pid, signal.SIGKILL)
            process.wait()

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *error) -> None:
        if any(process.poll() is None for process in self.processes):
            self.kill()


def _children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux's /proc; none found elsewhere)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rpartition(")")[2].split()
            if int(fields[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def _recorded_steps(folder: Path) -> list[int]:
    """The steps of the train_step records written so far (a line being written is skipped)."""
    steps = []
    if (folder / METRICS).exists():
        for line in (folder / METRICS).read_text().splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                steps += [record["step"]] if record.get("kind") == "train_step" else []
    return steps


def _evaluated(folder: Path) -> list[int]:
    """The evaluated steps. A run ends with an evaluation unless the step before had one."""
    return [record["step"] for record in read_metrics(folder, "eval")]


def _ended_at(nodes: Nodes) -> int:
    found = re.search(r"run folder: .* \(step (\d+)\)", nodes.main_output())
    assert found, nodes.main_output()
    return int(found.group(1))


def test_two_nodes_train_through_a_budget_a_signal_and_a_resume(tokens, tmp_path):
    folder = tmp_path / "run"

    # A time budget, with evaluations on the way and at its end: both nodes end, exit 0.
    with Nodes(
        "budget", tokens, folder, FOREVER, "--time-budget", "2s", "--eval-every", "4"
    ) as nodes:
        assert nodes.finish() == [0, 0]
    budgeted = _ended_at(nodes)
    evaluated = _evaluated(folder)
    assert len(evaluated) >= 2 and budgeted - evaluated[-1] <= 1, (evaluated, budgeted)
    assert checkpoint.step_of(checkpoint.latest(folder)) == budgeted

    # Resumed for good; SIGTERM to one node's torchrun, which hands it to its worker: both
    # ranks stop after the step they are in, with a checkpoint, and both torchruns end (exit 1:
    # one worker ended with 128 + the signal, the other rank's with 130).
    with Nodes("signal", tokens, folder, FOREVER, "--resume", "--time-budget", "1h") as nodes:
        wait_for(
            lambda: max(_recorded_steps(folder), default=0) > budgeted + 2,
            "steps after the resume",
            nodes.processes[0],
            timeout=TIMEOUT,
        )
        nodes.processes[0].send_signal(signal.SIGTERM)
        assert nodes.finish() == [1, 1]
    assert re.search(r"exitcode\s*:\s*130", nodes.output(1, "err")), nodes.output(1, "err")
    stopped = STOPPED.search(nodes.main_output())
    assert stopped, nodes.main_output()
    signalled = int(stopped.group(2))
    assert signalled > budgeted + 2
    assert checkpoint.step_of(checkpoint.latest(folder)) == signalled == _ended_at(nodes)
    assert max(losses(folder)) == signalled

    # The same command with --resume and a last step: both exit 0 there, every step recorded.
    final = signalled + 5
    with Nodes("resume", tokens, folder, final, "--resume", "--time-budget", "1h") as nodes:
        assert nodes.finish() == [0, 0]
    assert _ended_at(nodes) == final
    assert sorted(losses(folder)) == list(range(1, final + 1))
    assert final - _evaluated(folder)[-1] <= 1
    _model, _tokenizer, step = load_run(folder, step="last")
    assert step == final


def test_no_ddp_wrapper_outlives_the_run_into_the_teardown(tokens, tmp_path):
    """Two spawned ranks that join their process group as torchrun's workers do (from the
    environment, so the run destroys it): when the group is destroyed, no DDP wrapper is left
    to hold it."""
    spawn(_count_wrappers, (str(tokens), str(tmp_path), free_port()), 2, TIMEOUT, "two ranks")
    for rank in range(2):
        assert json.loads((tmp_path / f"rank{rank}.json").read_text()) == [0], rank


def _count_wrappers(rank: int, tokens: str, folder: str, port: int) -> None:
    """One rank of :func:`test_no_ddp_wrapper_outlives_the_run_into_the_teardown`: a short DDP
    run, counting the DDP wrappers alive when the run destroys its process group."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="localhost", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)
    counted, teardown = [], distributed.teardown

    def counting(cluster) -> None:
        gc.collect()
        counted.append(sum(issubclass(type(o), DistributedDataParallel) for o in gc.get_objects()))
        teardown(cluster)

    distributed.teardown = counting
    train(*configs(Path(tokens), steps=2, eval_every=1), Path(folder, "run"), progress=False)
    Path(folder, f"rank{rank}.json").write_text(json.dumps(counted))
