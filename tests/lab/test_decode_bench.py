"""The decode benchmark measures what generate does, and records what it measured."""

from __future__ import annotations

import pytest
import torch

from octlm import records
from octlm.lab.bench import decode as bench
from octlm.model import ModelConfig, OctLM

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = ModelConfig(vocab_size=64, width=32, n_layers=2, n_heads=4, n_kv_heads=2, max_length=40)


def test_chunked_prefill_then_decode_equals_generate_and_rewinds():
    model = OctLM(TINY).eval()
    prompt = torch.randint(64, (2, 21), generator=torch.Generator().manual_seed(3))
    expected = model.generate(prompt, 6)[:, 21:]  # (B, 6)
    with torch.inference_mode():
        cache, logits = bench.prefill(model, prompt, chunk=8)
        _, tokens = bench.decode(model, cache, logits, 6)
        cache.length = 21  # the benchmark's rewind
        _, again = bench.decode(model, cache, logits, 6)
    assert torch.equal(tokens, expected)
    assert torch.equal(again, expected)


def test_records_carry_context_load_and_every_stage(tmp_path):
    output = tmp_path / "decode.jsonl"
    bench.main(
        ["--contexts", "24", "--new-tokens", "3", "--rounds", "2", "--repeats", "2",
         "--chunk", "10", "--kv-heads", "2", "--output", str(output)]
    )  # fmt: skip
    written = list(records.read(output))
    assert [r["attention"] for r in written if r["stage"] == "prefill"] == ["sdpa"]
    stages = {(r["stage"], r["attention"], r.get("layout")) for r in written}
    for name in bench.ATTENTIONS:
        assert ("decode", name, None) in stages
        assert {("attention", name, "cache"), ("attention", name, "contiguous")} <= stages
    for record in written:
        assert {"experiment", "time", "torch", "device", "threads", "host_cpu"} <= record.keys()
        assert {"loadavg_before", "loadavg_after", "cpu_share"} <= record.keys()
        assert record["context"] == 24 and record["n_kv_heads"] == 2
    decoded = [r for r in written if r["stage"] == "decode"]
    assert [r["round"] for r in decoded] == [0, 0, 1, 1]
    assert [r["attention"] for r in decoded] == ["tiled", "sdpa", "sdpa", "tiled"]  # alternating
    assert all(r["tokens"] == decoded[0]["tokens"] for r in decoded)


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--output", "{tmp}/file/decode.jsonl"], "--output '"),
        (["--output", "{tmp}"], "it is a folder"),
        (["--kv-heads", "3"], "--kv-heads or --block: n_heads (8) must be a multiple"),
    ],
)
def test_bad_arguments_fail_in_one_line_before_measuring(tmp_path, capsys, arguments, message):
    (tmp_path / "file").write_text("")
    arguments = [a.format(tmp=tmp_path) for a in arguments]
    with pytest.raises(SystemExit) as stop:
        bench.main(["--contexts", "8", *arguments])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--documents", "0"], "--documents: must be an int >= 1, got 0"),
        (["--modes", "bogus"], "invalid choice: 'bogus'"),
        (["--documents", "300"], "--documents (300) cannot exceed --length (256)"),
        (["--output", "{tmp}"], "it is a folder"),
    ],
)
def test_documents_benchmark_refuses_bad_arguments(tmp_path, capsys, arguments, message):
    from octlm.lab.bench import documents

    arguments = [a.format(tmp=tmp_path) for a in arguments]
    with pytest.raises(SystemExit) as stop:
        documents.main(["--length", "256", "--no-flex", *arguments])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
