"""``benchmarks/gguf_bits.py``: a GGUF file's held-out bits per byte in llama.cpp beside octlm's,
by one protocol; the float32 file gives octlm's figure, q8_0 one close to it; and octlm's q8_0
file is llama.cpp's own quantization of the float32 one, byte for byte."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from octlm.cli import main
from octlm.training import train
from octlm.training.config import resolve
from tests.integrations.test_gguf import WITHOUT_LLAMA_CPP
from tests.training_helpers import TINY_MODEL, TINY_RUN

gguf = pytest.importorskip("gguf")

BENCHMARKS = Path(__file__).parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # gguf_bits imports held_out_bits, its neighbour
spec = importlib.util.spec_from_file_location("gguf_bits", BENCHMARKS / "gguf_bits.py")
gguf_bits = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gguf_bits)


@pytest.fixture
def exported(corpus, tmp_path) -> Path:
    """A short run whose matrices' rows are whole q8_0 blocks (width 32) but for the MLP's
    down projection (88), exported in float32 and q8_0."""
    model_config, run = resolve(
        model={**TINY_MODEL, "width": 32}, run={**TINY_RUN, "data": str(corpus), "steps": 6}
    )
    train(model_config, run, tmp_path / "run", progress=False)
    for dtype in ("float32", "q8_0"):
        assert main(["export", str(tmp_path / "run"), str(tmp_path / f"{dtype}.gguf"),
                     "--dtype", dtype]) == 0  # fmt: skip
    return tmp_path


def test_matrix_types_count_what_the_file_holds(exported):
    assert gguf_bits.matrix_types(exported / "float32.gguf") == {"F32": 8}
    assert gguf_bits.matrix_types(exported / "q8_0.gguf") == {"F16": 1, "Q8_0": 7}


def test_llama_cpp_scores_the_float32_file_as_octlm_does(exported, capsys):
    pytest.importorskip("llama_cpp", reason=WITHOUT_LLAMA_CPP)
    files = [str(exported / "float32.gguf"), str(exported / "q8_0.gguf")]
    assert gguf_bits.main([str(exported / "run"), *files]) == 0
    found = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [record["file"] for record in found] == files
    assert found[0]["ratio"] == pytest.approx(1, abs=1e-4)
    assert found[1]["ratio"] == pytest.approx(1, abs=5e-3)


def test_octlm_s_q8_0_is_llama_cpp_s_own_byte_for_byte(exported):
    """Where rows fit, the same blocks; where they do not (the MLP's 88), float16 in both."""
    pytest.importorskip("llama_cpp", reason=WITHOUT_LLAMA_CPP)
    theirs = gguf_bits.quantize(exported / "float32.gguf", "Q8_0")
    ours = {
        t.name: (t.tensor_type, np.array(t.data))
        for t in gguf.GGUFReader(exported / "q8_0.gguf").tensors
    }
    for tensor in gguf.GGUFReader(theirs).tensors:
        kind, data = ours[tensor.name]
        assert kind == tensor.tensor_type, tensor.name
        assert np.array_equal(data, np.array(tensor.data)), tensor.name
