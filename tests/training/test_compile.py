"""The model compiles whole: no graph break in a training step and no recompilation after the
first, counted by dynamo itself (a counting backend, so no C++ compiler is needed); --compile's
modes, the rule of ``auto``, and a compilation that fails."""

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from octlm.cli import build_parser
from octlm.model import ModelConfig, OctLM
from octlm.training import compiled, config
from octlm.training import flags as flags_module
from tests.training_helpers import losses, tiny_flags, write_corpus

SOURCES = str(Path(__file__).resolve().parents[2] / "src")


@pytest.mark.parametrize("attention", ["auto", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_training_step_is_one_graph_and_compiles_once(attention, dtype):
    torch._dynamo.reset()
    config = ModelConfig(vocab_size=64, width=32, n_layers=2, n_heads=4, n_kv_heads=2,
                         max_length=32, attention=attention)  # fmt: skip
    model = OctLM(config)
    from torch._dynamo.testing import CompileCounter  # loads Triton: not before its tests

    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=False)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        tokens = torch.randint(0, 64, (2, 32), generator=generator)  # (B, T)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            logits = compiled(tokens)  # (B, T, V)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
        loss.backward()
    assert counter.frame_count == 1  # one graph: no break, and no recompilation


def test_compiled_logits_equal_eager_ones_and_eager_still_checks_token_values():
    torch._dynamo.reset()
    model = OctLM(ModelConfig(vocab_size=64, width=32, n_layers=1, n_heads=4, max_length=16))
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(tokens), model(tokens), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, vocab_size=64\)"):
        model(tokens + 64)


@pytest.mark.parametrize(
    ("flags", "mode"),
    [([], "auto"), (["--compile"], "on"), (["--compile", "off"], "off"), (["--no-compile"], "off"),
     (["--compile", "auto"], "auto")],
)  # fmt: skip
def test_compile_flag_spellings(flags, mode):
    parser = build_parser(["train"])
    _model, run = flags_module.explicit_values(parser.parse_args(["train", *flags]))
    assert run.get("compile", "auto") == mode


def test_a_compile_mode_is_checked_and_a_stored_switch_still_reads():
    assert compiled.check_mode(True) == "on" and compiled.check_mode(False) == "off"
    with pytest.raises(ValueError, match=r"compile must be one of \('auto', 'on', 'off'\)"):
        config.RunConfig(compile="yes")


def test_auto_compiles_only_where_its_rule_holds(monkeypatch):
    cpu, long_run = torch.device("cpu"), config.RunConfig(steps=compiled.LONG_STEPS)
    short_run = config.RunConfig(steps=compiled.LONG_STEPS - 1)
    monkeypatch.setenv("CXX", "g++")
    monkeypatch.setattr(compiled.shutil, "which", lambda name: f"/usr/bin/{name}")
    assert compiled.compiles_here(long_run, cpu)[0]
    assert not compiled.compiles_here(short_run, cpu)[0]
    assert compiled.compiles_here(config.RunConfig(time_budget="5m"), cpu)[0]
    assert not compiled.compiles_here(config.RunConfig(time_budget="1m"), cpu)[0]
    assert compiled.compiles_here(replace(short_run, compile="on"), cpu)[0]
    assert not compiled.compiles_here(replace(long_run, compile="off"), cpu)[0]
    monkeypatch.setattr(compiled.shutil, "which", lambda name: None)
    compiles, reason = compiled.compiles_here(long_run, cpu)
    assert not compiles and "no C++ compiler" in reason


def test_a_failed_compilation_is_one_line_and_the_run_goes_on_eagerly(tmp_path):
    """A C++ compiler that is not there: inductor fails, the run trains eagerly to its end."""
    corpus = write_corpus(tmp_path / "corpus")
    flags = tiny_flags(corpus, tmp_path / "run", steps=2)
    environment = {**os.environ, "CXX": str(tmp_path / "no-such-g++"), "PYTHONPATH": SOURCES}
    done = subprocess.run(
        [sys.executable, "-m", "octlm", *flags, "--compile", "on"],
        capture_output=True, text=True, env=environment, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    failed = [line for line in done.stderr.splitlines() if "torch.compile failed" in line]
    assert len(failed) == 1 and failed[0].endswith("the run goes on eagerly")
    stored = json.loads((tmp_path / "run" / config.CONFIG_FILE).read_text())
    assert stored["run"]["compile"] == "on"
    assert len(losses(tmp_path / "run")) == 2
