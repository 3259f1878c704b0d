"""octlm export: the folder transformers loads gives octlm's logits (to the precision of
transformers' float32 RoPE), greedy tokens and tokenizer ids, for byte and BPE runs, with and
without a window, also in a process that cannot import octlm; a failed or interrupted export
leaves nothing behind.

Tiny models with random peaked weights, written as run folders by hand; nothing is downloaded.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from octlm import ModelConfig, OctLM  # noqa: E402
from octlm.cli import main  # noqa: E402
from octlm.export import export, export_model  # noqa: E402
from tests.transformers_folders import (  # noqa: E402
    TEXTS,
    make_run,
    peaked,
    rope_tolerance,
    train_bpe,
)

CONFIG = ModelConfig(vocab_size=256, width=32, n_layers=2, n_heads=4, n_kv_heads=2, max_length=64)
# The architecture an export is, by the fields of octlm's model that choose it.
ARCHITECTURES = {
    "llama": {},
    "mistral": {"window": 8},
    "qwen3": {"qk_norm": True},
    "qwen3-window": {"qk_norm": True, "window": 8},
}
CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
LENGTH = 40
SOURCE = Path(__file__).parents[2] / "src"

pytestmark = pytest.mark.usefixtures("one_thread")


def token_ids(vocab: int, length: int = LENGTH) -> torch.Tensor:
    return torch.randint(vocab, (2, length), generator=torch.Generator().manual_seed(1))


def reference_logits(model: OctLM, ids: torch.Tensor) -> torch.Tensor:
    """octlm's logits in float64, from a float64 copy of the model's weights."""
    with torch.no_grad():
        return copy.deepcopy(model).double()(ids)  # (B, T, V)


def exported_run(root: Path, architecture: str) -> tuple[Path, dict, Path]:
    """A byte run (two checkpoints) of ``architecture``, exported at its latest checkpoint:
    (run folder, its models by step, the exported folder)."""
    models = make_run(root / "run", replace(CONFIG, **ARCHITECTURES[architecture]))
    export(root / "run", root / "out")
    return root / "run", models, root / "out"


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def exported(request, tmp_path_factory):
    """:func:`exported_run` of the architecture ``request.param``."""
    return exported_run(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logits_equal_octlm_to_the_precision_of_transformers_rope(exported, attn, dtype):
    _run, models, out = exported
    model = models[4]
    theirs = AutoModelForCausalLM.from_pretrained(out, attn_implementation=attn, dtype=dtype)
    expected = "Qwen3ForCausalLM" if model.config.qk_norm else CLASSES[theirs.config.model_type]
    assert type(theirs).__name__ == expected
    assert hasattr(theirs.model.layers[0].self_attn, "q_norm") == model.config.qk_norm
    assert getattr(theirs.config, "sliding_window", None) == (model.config.window or None)
    ids = token_ids(CONFIG.vocab_size)
    with torch.no_grad():
        logits = theirs.eval()(ids).logits  # (B, T, V)
    reference = reference_logits(model, ids)
    assert logits.dtype == dtype
    error = (logits.double() - reference).abs().max().item()
    assert error <= rope_tolerance(reference), error


def test_greedy_generation_gives_octlm_tokens(exported):
    _run, models, out = exported
    theirs = AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = token_ids(CONFIG.vocab_size, length=9)[:1]
    tokens = theirs.generate(prompt, max_new_tokens=24, do_sample=False)
    assert torch.equal(tokens, models[4].generate(prompt, 24))


def test_byte_tokenizer_ids_are_the_utf8_bytes(exported):
    _run, _models, out = exported
    tokenizer = AutoTokenizer.from_pretrained(out)
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == list(text.encode()), text
        assert tokenizer.decode(ids) == text
    broken = [0xFF, ord("A"), 0xE2, 0x98]  # bytes no UTF-8 text holds, then a cut sequence
    assert tokenizer.decode(broken) == bytes(broken).decode(errors="replace")


def test_an_earlier_step_exports_that_checkpoint(exported, tmp_path):
    run, models, _out = exported
    export(run, tmp_path / "out", step=2)
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = token_ids(CONFIG.vocab_size)
    with torch.no_grad():
        logits = theirs(ids).logits
    reference = reference_logits(models[2], ids)
    assert (logits.double() - reference).abs().max().item() <= rope_tolerance(reference)
    with pytest.raises(ValueError, match=r"one of the run's checkpoints \[2, 4\], got 3"):
        export(run, tmp_path / "other", step=3)


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_bpe_run_exports_its_tokenizer_and_model(architecture, tmp_path):
    bpe = train_bpe(tmp_path / "tokenizer.json")
    from tokenizers import Tokenizer

    octlm_tokenizer = Tokenizer.from_file(str(bpe))  # its ids are octlm's, by the run's contract
    vocab_size = octlm_tokenizer.get_vocab_size()
    config = replace(CONFIG, vocab_size=vocab_size, **ARCHITECTURES[architecture])
    models = make_run(tmp_path / "run", config, tokenizer=bpe)
    export(tmp_path / "run", tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    for text in TEXTS:
        ids = tokenizer(text)["input_ids"]
        assert ids == octlm_tokenizer.encode(text).ids, text
        assert tokenizer.decode(ids) == text
    assert len(octlm_tokenizer.encode(TEXTS[0]).ids) < len(TEXTS[0].encode())  # merges used
    ids = torch.tensor([octlm_tokenizer.encode(TEXTS[1] + TEXTS[0]).ids])
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        logits = theirs(ids).logits
    reference = reference_logits(models[4], ids)
    assert (logits.double() - reference).abs().max().item() <= rope_tolerance(reference)


def test_the_end_of_text_token_is_named_and_ends_generation(tmp_path):
    """A BPE of octlm's own training: its end token is the export's eos everywhere, no token
    is added to a text, and --init-from takes the folder's tokenizer, end token and all."""
    from octlm.integrations.tokenizer_files import bpe_file
    from octlm.tokenizer import END_OF_TEXT, BPETokenizer
    from octlm.training.sample import generate_text

    texts = [text.replace(END_OF_TEXT, "").encode() for text in TEXTS] * 20
    bpe = BPETokenizer.train(texts, 300)
    bpe.save(tmp_path)
    end = bpe.end_token
    config = replace(CONFIG, vocab_size=300, tied_head=False)
    model = make_run(tmp_path / "run", config, tokenizer=tmp_path / "tokenizer.json")[4]
    ids = bpe.encode(b"def ")
    with torch.no_grad():  # the head row of the end token: 1.5 x that of the 6th greedy token
        sixth = model.generate(torch.tensor([ids]), 6)[0, -1]
        model.head.weight[end] = 1.5 * model.head.weight[sixth]
    export_model(model, tmp_path / "out", tokenizer=tmp_path / "tokenizer.json")
    read = {name: json.loads((tmp_path / "out" / name).read_text()) for name in (
        "config.json", "generation_config.json", "tokenizer_config.json")}  # fmt: skip
    assert read["config.json"]["eos_token_id"] == end == 299
    assert read["generation_config.json"]["eos_token_id"] == end
    assert read["tokenizer_config.json"]["eos_token"] == END_OF_TEXT
    assert read["tokenizer_config.json"]["add_bos_token"] is False
    assert read["tokenizer_config.json"]["add_eos_token"] is False
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.eos_token_id == end and tokenizer("def ")["input_ids"] == ids
    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        drawn = theirs.generate(torch.tensor([ids]), max_new_tokens=30, do_sample=False)
    drawn = drawn[0, len(ids) :].tolist()
    assert drawn[-1] == end and end not in drawn[:-1] and len(drawn) <= 6  # it stopped there
    ours = generate_text(model, "def ", 30, tokenizer=bpe)
    assert ours == (b"def " + bpe.decode(drawn[:-1])).decode(errors="replace")
    assert bpe_file(tmp_path / "out", 300) == tmp_path / "out" / "tokenizer.json"


BLOCKED = """
import sys

class NoOctlm:
    def find_spec(self, name, path=None, target=None):
        if name == "octlm" or name.startswith("octlm."):
            raise ImportError("octlm is not installed here")

sys.meta_path.insert(0, NoOctlm())
try:
    import octlm
except ImportError:
    pass
else:
    raise SystemExit("octlm was importable")

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

text, *pairs = sys.argv[1:]
for folder, output in zip(pairs[::2], pairs[1::2]):
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([AutoTokenizer.from_pretrained(folder)(text)["input_ids"]])
    with torch.no_grad():
        logits = model(ids).logits
    tokens = model.generate(ids, max_new_tokens=16, do_sample=False)
    torch.save({"ids": ids, "logits": logits, "tokens": tokens}, output)
"""


@pytest.fixture(scope="module")
def read_without_octlm(tmp_path_factory) -> dict:
    """By architecture: the models of its export by step, and the ids, logits and greedy tokens
    that a process which cannot import octlm reads from the exported folder. One process reads
    every architecture, since its imports of torch and transformers cost seconds."""
    root = tmp_path_factory.mktemp("blocked")
    runs = {name: exported_run(root / name, name) for name in ARCHITECTURES}
    pairs = [str(part) for name, run in runs.items() for part in (run[2], root / f"{name}.pt")]
    environment = {**os.environ, "PYTHONPATH": str(SOURCE)}  # octlm is findable, and blocked
    subprocess.run([sys.executable, "-c", BLOCKED, TEXTS[1], *pairs], check=True, env=environment)
    return {name: (run[1], torch.load(root / f"{name}.pt")) for name, run in runs.items()}


@pytest.mark.parametrize("architecture", list(ARCHITECTURES))
def test_the_folder_loads_where_octlm_cannot_be_imported(read_without_octlm, architecture):
    models, got = read_without_octlm[architecture]
    text = TEXTS[1]
    assert got["ids"][0].tolist() == list(text.encode())
    reference = reference_logits(models[4], got["ids"])
    assert (got["logits"].double() - reference).abs().max().item() <= rope_tolerance(reference)
    assert torch.equal(got["tokens"], models[4].generate(got["ids"], 16))


def test_a_model_file_exports_with_bytes_only_when_its_vocabulary_is_bytes(tmp_path):
    for vocab in (256, 100):
        model = peaked(OctLM(replace(CONFIG, vocab_size=vocab)))
        model.save(tmp_path / f"model-{vocab}.pt")
        exported = export(tmp_path / f"model-{vocab}.pt", tmp_path / f"out-{vocab}")
        assert exported.step is None
        assert exported.tokenizer == ("bytes" if vocab == 256 else None)
        has_tokenizer = (tmp_path / f"out-{vocab}" / "tokenizer.json").exists()
        assert has_tokenizer == (vocab == 256)
        theirs = AutoModelForCausalLM.from_pretrained(tmp_path / f"out-{vocab}").eval()
        ids = token_ids(vocab)
        with torch.no_grad():
            logits = theirs(ids).logits
        reference = reference_logits(model, ids)
        assert (logits.double() - reference).abs().max().item() <= rope_tolerance(reference)
    with pytest.raises(ValueError, match=r"step picks a checkpoint of a run folder.*model file"):
        export(tmp_path / "model-256.pt", tmp_path / "again", step=2)


def test_cli_exports_once_and_refuses_a_folder_that_holds_something(exported, tmp_path, capsys):
    run, _models, _out = exported
    assert main(["export", str(run), str(tmp_path / "out")]) == 0
    said = capsys.readouterr().out
    assert "checkpoint of step 4" in said and "tokenizer bytes" in said
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json",
    ]  # fmt: skip
    assert main(["export", str(run), str(tmp_path / "out")]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "nothing"), str(tmp_path / "other")]) == 2
    assert "does not exist: expected a run folder or a model file" in capsys.readouterr().err


@contextlib.contextmanager
def small_disk(folder: Path, size: str):
    """A tmpfs of ``size`` mounted on ``folder``: a real filesystem that fills up; the test is
    skipped where mounting is not permitted."""
    folder.mkdir()
    try:
        mounted = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
            capture_output=True,
        )
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


# Pages of 4 KiB: the export of CONFIG is 2 small JSON files, 32 pages of weights, then the
# tokenizer files, so these sizes run out at each of the files in turn (and in the GGUF file).
@pytest.mark.parametrize(
    "size, out", [("4k", "out"), ("8k", "out"), ("64k", "out"), ("136k", "out"),
                  ("140k", "out"), ("64k", "model.gguf")],
)  # fmt: skip
def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, capsys, size, out):
    model = peaked(OctLM(CONFIG))
    model.save(tmp_path / "model.pt")
    with small_disk(tmp_path / "disk", size) as disk:
        assert main(["export", str(tmp_path / "model.pt"), str(disk / out)]) == 1
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and "No space left on device" in error, error
        assert list(disk.iterdir()) == []


def test_every_exported_file_follows_the_umask(tmp_path):
    peaked(OctLM(CONFIG)).save(tmp_path / "model.pt")
    previous = os.umask(0o022)
    try:
        export(tmp_path / "model.pt", tmp_path / "out")
        export(tmp_path / "model.pt", tmp_path / "model.gguf")
    finally:
        os.umask(previous)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert set(modes.values()) == {0o644}, modes
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "model.gguf").stat().st_mode & 0o777 == 0o644


def test_an_output_under_a_file_is_refused_in_one_line(exported, tmp_path, capsys):
    run, _models, _out = exported
    (tmp_path / "a-file").write_text("")
    for out in ("a-file/out", "a-file/deeper/out", "a-file/model.gguf"):
        assert main(["export", str(run), str(tmp_path / out)]) == 2
        error = capsys.readouterr().err
        assert f"{str(tmp_path / 'a-file')!r} is a file, not a folder" in error
        assert error.count("\n") == 1


SLOW_WRITE = """
import sys, time
from pathlib import Path
from octlm.cli import main
from octlm.integrations import llama_format

def slow(tensors, metadata=None):
    Path(sys.argv[3]).touch()
    time.sleep(60)

llama_format.save = slow
sys.exit(main(["export", sys.argv[1], sys.argv[2]]))
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_export_removes_what_it_wrote(signum, tmp_path):
    peaked(OctLM(CONFIG)).save(tmp_path / "model.pt")
    out, writing = tmp_path / "exports" / "out", tmp_path / "writing"
    out.parent.mkdir()
    environment = {**os.environ, "PYTHONPATH": str(SOURCE)}
    process = subprocess.Popen(
        [sys.executable, "-c", SLOW_WRITE, str(tmp_path / "model.pt"), str(out), str(writing)],
        env=environment,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not writing.exists() and process.poll() is None:
            time.sleep(0.05)
        assert any(out.parent.iterdir())  # the staging folder, mid-write
        process.send_signal(signum)
        _, err = process.communicate(timeout=60)
    finally:
        process.kill()
    assert process.returncode == 128 + signum
    assert f"stopped by {signal.Signals(signum).name}" in err
    assert list(out.parent.iterdir()) == []
