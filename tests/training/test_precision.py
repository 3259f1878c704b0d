"""--dtype auto: bfloat16 autocast where the hardware has bfloat16 units, float32 elsewhere,
chosen once and kept by the run (config.json holds the resolved dtype); Muon's iteration
follows it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from octlm import machine
from octlm.training import loop, precision, resolve, train
from octlm.training.config import CONFIG_FILE
from tests.training_helpers import TINY_MODEL, TINY_RUN

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
WITHOUT = frozenset({"fpu", "sse2", "avx2", "avx512f", "avx512bw"})


@pytest.fixture
def cpu_has(monkeypatch):
    """``cpu_has(flags)``: the CPU's /proc/cpuinfo flags, as the run reads them, from then on."""

    def patch(flags):
        monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset(flags))

    return patch


@pytest.mark.parametrize(
    "flags, chosen",
    [
        (WITHOUT, "float32"),
        (WITHOUT | {"avx512_bf16"}, "bfloat16"),
        (WITHOUT | {"amx_bf16", "amx_tile"}, "bfloat16"),
        (frozenset(), "float32"),
    ],
)
def test_auto_picks_bfloat16_only_on_a_cpu_with_bfloat16_units(cpu_has, flags, chosen):
    cpu_has(flags)
    assert precision.resolve_dtype("auto", CPU) == chosen
    for named in ("float32", "bfloat16"):  # a dtype the user names is kept
        assert precision.resolve_dtype(named, CPU) == named


def test_cpu_flags_are_read_from_proc_cpuinfo_where_there_is_one():
    flags = machine.cpu_flags()
    try:
        listed = Path("/proc/cpuinfo").read_text()
    except OSError:
        assert flags is None
        return
    assert flags and all(flag in listed for flag in flags)


def start(corpus, folder, **run):
    model_config, run_config = resolve(
        model=TINY_MODEL, run={**TINY_RUN, "data": str(corpus), "steps": 2, "dtype": "auto", **run}
    )
    return train(model_config, run_config, folder, progress=False)


@pytest.mark.parametrize("flags, chosen", [(WITHOUT, "float32"), ({"avx512_bf16"}, "bfloat16")])
def test_the_run_stores_and_announces_the_dtype_auto_chose(
    corpus, tmp_path, capsys, cpu_has, flags, chosen
):
    cpu_has(flags)
    start(corpus, tmp_path / "run")
    assert json.loads((tmp_path / "run" / CONFIG_FILE).read_text())["run"]["dtype"] == chosen
    units = "has" if chosen == "bfloat16" else "lacks"
    assert f"{chosen} (auto: the cpu {units} bfloat16 units)" in capsys.readouterr().out


def test_a_resumed_run_keeps_its_dtype_on_other_hardware(corpus, tmp_path, cpu_has):
    cpu_has({"avx512_bf16"})
    start(corpus, tmp_path / "run")
    cpu_has(WITHOUT)
    for flags in ({}, {"dtype": "auto"}):  # the same command line, --resume added
        model_config, run_config = resolve(
            run={"steps": 3 + len(flags), **flags}, resume=tmp_path / "run"
        )
        assert run_config.dtype == "bfloat16"
        train(model_config, run_config, tmp_path / "run", resume=True, progress=False)
    stored = json.loads((tmp_path / "run" / CONFIG_FILE).read_text())
    assert stored["run"]["dtype"] == "bfloat16"


def test_a_run_folder_older_than_its_defaults_resumes_as_it_began(corpus, tmp_path, cpu_has):
    """A config.json without dtype, tokenizer or optimizer was float32, bytes and AdamW, not
    today's defaults (auto, BPE, Muon)."""
    cpu_has({"avx512_bf16"})
    start(corpus, tmp_path / "run", dtype="float32")
    path = tmp_path / "run" / CONFIG_FILE
    stored = json.loads(path.read_text())
    for name in ("dtype", "tokenizer", "optimizer"):  # written before the fields were stored
        del stored["run"][name]
    path.write_text(json.dumps(stored))
    model_config, run_config = resolve(run={"steps": 3}, resume=tmp_path / "run")
    assert (run_config.dtype, run_config.tokenizer, run_config.optimizer) == (
        "float32",
        "bytes",
        "adamw",
    )
    train(model_config, run_config, tmp_path / "run", resume=True, progress=False)


def test_muon_orthogonalises_in_the_runs_precision(corpus, tmp_path, cpu_has):
    cpu_has({"avx512_bf16"})
    model_config, run = resolve(
        model=TINY_MODEL,
        run={**TINY_RUN, "data": str(corpus), "optimizer": "muon", "dtype": "bfloat16"},
    )
    train(model_config, run, tmp_path / "run", progress=False)  # prepares the folder
    for dtype, expected in (("bfloat16", torch.bfloat16), ("float32", torch.float32)):
        run.dtype = dtype
        cluster = loop.distributed.setup("cpu", fsdp=False, context_parallel=False)
        state = loop.Training.build(model_config, run, tmp_path / "run", cluster, None, False)
        muon = [part for part in state.optimizer.parts if hasattr(part, "precision")]
        assert [part.precision for part in muon] == [expected]
