"""A disk that fills while a checkpoint or a model file is written: the temporary file goes,
the error names the file and the reason in one line, earlier checkpoints stay, and ``--resume``
once there is space repeats the uninterrupted run's losses exactly."""

from __future__ import annotations

import errno
import hashlib

import pytest
import torch

from octlm.cli import main
from octlm.model import ModelConfig, OctLM
from octlm.training import checkpoint
from tests.training_helpers import losses, tiny_flags, write_corpus

SAVE = torch.save


class FillingDisk:
    """A file that takes ``room`` bytes and then fails as a full disk does."""

    def __init__(self, out, room: int):
        self.out, self.room = out, room

    def write(self, data) -> int:
        if len(data) > self.room:
            self.out.write(bytes(data[: self.room]))
            self.room = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.out.write(data)

    def flush(self) -> None:
        self.out.flush()


def fill_disk_on(monkeypatch, writes: set[int], room: int = 4096) -> None:
    """``torch.save`` calls whose number is in ``writes`` (from 1) meet a full disk after
    ``room`` bytes."""
    calls = []

    def save(contents, out, *args, **kwargs):
        calls.append(1)
        target = FillingDisk(out, room) if len(calls) in writes else out
        return SAVE(contents, target, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def test_a_full_disk_at_a_checkpoint_keeps_the_others_and_resume_is_exact(
    tmp_path, capsys, monkeypatch
):
    corpus = write_corpus(tmp_path / "corpus")
    flags = ["--checkpoint-every", "2", "--keep", "10"]
    assert main([*tiny_flags(corpus, tmp_path / "whole", steps=6), *flags]) == 0
    folder = tmp_path / "cut"
    fill_disk_on(monkeypatch, writes={2})  # the checkpoint of step 4
    capsys.readouterr()
    assert main([*tiny_flags(corpus, folder, steps=6), *flags]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "No space left on device" in err
    assert str(checkpoint.path_for(folder, 4)) in err
    assert [p.name for p in checkpoint.listed(folder)] == ["checkpoint-0000002.pt"]
    assert not [p for p in folder.rglob("*") if p.name.endswith(".tmp")]
    monkeypatch.setattr(torch, "save", SAVE)  # space was freed
    assert main([*tiny_flags(corpus, folder, steps=6), *flags, "--resume"]) == 0
    assert losses(folder) == losses(tmp_path / "whole")  # exact, float for float


def test_a_full_disk_while_a_model_is_saved_keeps_the_old_file(tmp_path, monkeypatch):
    model = OctLM(ModelConfig(vocab_size=64, width=32, n_layers=1, n_heads=2, max_length=16))
    path = tmp_path / "model.pt"
    model.save(path)
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    fill_disk_on(monkeypatch, writes={1})
    with pytest.raises(OSError, match="No space left on device") as caught:
        model.save(path)
    assert caught.value.errno == errno.ENOSPC and str(path) in str(caught.value)
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]  # no temporary file left
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
