"""octlm train --tokenizer bpe: token files that decode to every document, a tokenizer that saw
only the training split, bits per byte over the bytes tokens cover, sampling, resuming, packing.

Runs use a model of a few thousand parameters and a vocabulary of 300 on a few kilobytes of
text, so each takes about a second.
"""

from __future__ import annotations

import itertools
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from octlm import load_run
from octlm.cli import main
from octlm.model import ModelConfig, OctLM
from octlm.tokenizer import TOKENIZER_FILE, BPETokenizer, ByteTokenizer, load_tokenizer
from octlm.training import train
from octlm.training.batches import Batches, PackedBatches, evaluation_batches
from octlm.training.config import resolve
from octlm.training.sample import generate_text
from octlm.training.tokens import SPLITS, load_starts, load_tokens

WORDS = ["def", " return", " self", "(x)", ":", "\n    ", " héllo", " wörld", " 中文", " = 1"]
VOCAB = 300
MODEL = dict(width=16, n_layers=1, n_heads=2, n_kv_heads=1)
RUN = dict(
    tokenizer="bpe", steps=4, batch=4, length=16, eval_every=2, eval_batches=2,
    checkpoint_every=2, keep=10, log_every=1, sample_tokens=4, warmup=1, lr=1e-2,
    dtype="float32", optimizer="adamw",
)  # fmt: skip


def write_corpus(folder: Path, documents: int = 12, words: int = 300) -> Path:
    """Text files of corpus words; one holds bytes that are not UTF-8, one is short."""
    generator = torch.Generator().manual_seed(0)
    for index in range(documents):
        picks = torch.randint(len(WORDS), (words,), generator=generator).tolist()
        text = "".join(WORDS[i] for i in picks).encode()
        text = text + b"\xff\xc3(" if index == 5 else text[: 3 + 40 * index]
        path = folder / f"part{index % 2}" / f"doc{index}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text)
    return folder


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_corpus(tmp_path / "corpus")


def configs(corpus: Path, model: dict | None = None, **run):
    return resolve(
        model={**MODEL, "vocab_size": VOCAB, **(model or {})},
        run={**RUN, "data": str(corpus), **run},
    )


def records(folder: Path, kind: str) -> list[dict]:
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def split_documents(folder: Path, split: str) -> list[bytes]:
    """The documents of one split, decoded from its token file at its document starts."""
    tokenizer = load_tokenizer(folder)
    tokens = load_tokens(folder / "data", split, 1).long()
    starts = [*load_starts(folder / "data", split).tolist(), len(tokens)]
    return [tokenizer.decode(tokens[a:b]) for a, b in itertools.pairwise(starts)]


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory) -> Path:
    """One finished BPE run (4 steps, checkpoints at 2 and 4), read by several tests."""
    root = tmp_path_factory.mktemp("bpe-run")
    train(*configs(write_corpus(root / "corpus")), root / "run", progress=False)
    return root / "run"


def test_token_files_decode_to_every_document(bpe_run):
    summary = json.loads((bpe_run / "data" / "data.json").read_text())
    assert (summary["tokenizer"], summary["vocab_size"], summary["dtype"]) == (
        "bpe",
        VOCAB,
        "uint16",
    )
    for split in SPLITS:
        size = (bpe_run / "data" / f"{split}.bin").stat().st_size
        assert size == 2 * summary[f"{split}_tokens"] < summary[f"{split}_bytes"]
    decoded = sorted(split_documents(bpe_run, "train") + split_documents(bpe_run, "val"))
    corpus = bpe_run.parent / "corpus"
    assert decoded == sorted(p.read_bytes() for p in corpus.rglob("*.txt"))  # \xff\xc3( too
    end = load_tokenizer(bpe_run).end_token
    assert summary["end_token"] == end == VOCAB - 1
    for split in SPLITS:  # each document ends with the end of text, and only there
        tokens = load_tokens(bpe_run / "data", split, 1)
        starts = load_starts(bpe_run / "data", split)
        ends = torch.cat([starts[1:], torch.tensor([len(tokens)])]) - 1
        assert torch.equal((tokens == end).nonzero().flatten(), ends)


def test_the_tokenizer_learns_from_the_training_split_only(tmp_path):
    """A single file holds out its tail: a word found only there gets no merge, while the same
    word in the head does."""
    head = "".join(WORDS * 40)
    for where, merged in (("tail", False), ("head", True)):
        text = head + " zqxv" * 60 if where == "tail" else " zqxv" * 60 + head
        corpus = tmp_path / f"{where}.txt"
        corpus.write_text(text)
        folder = tmp_path / where
        train(*configs(corpus, {"vocab_size": 270}, steps=1, val_share=0.2), folder, progress=False)
        tokenizer = load_tokenizer(folder)
        pieces = [tokenizer.decode([i]) for i in range(tokenizer.vocab_size)]
        assert any(b"zq" in piece for piece in pieces) == merged, where


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_bits_per_byte_are_token_losses_over_the_bytes_they_cover(corpus, tmp_path, tokenizer):
    """Recomputed in float64 from the final checkpoint on the fixed validation windows, and
    for the first step from its batch; for byte tokens it is the loss per token over log 2."""
    vocab = {"bytes": 256, "bpe": VOCAB}[tokenizer]
    model_config, run = configs(corpus, {"vocab_size": vocab}, tokenizer=tokenizer, eval_every=4)
    folder = tmp_path / "run"
    train(model_config, run, folder, progress=False)
    model, _tokenizer, step = load_run(folder)
    model = model.double()
    tokens = load_tokens(folder / "data", "val", run.length)
    vocabulary = load_tokenizer(folder)
    loss, covered = 0.0, 0
    for batch in evaluation_batches(tokens, run.length, run.batch, run.eval_batches):
        with torch.no_grad():
            logits = model(batch.inputs)  # (B, T, V) float64
        loss += float(
            F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten(), reduction="sum")
        )
        covered += sum(len(vocabulary.decode([t])) for t in batch.targets.flatten().tolist())
    evaluation = records(folder, "eval")[-1]
    assert evaluation["step"] == step == 4
    assert math.isclose(evaluation["val_bits_per_byte"], loss / math.log(2) / covered, rel_tol=1e-5)
    first = records(folder, "train_step")[0]
    batch = Batches(load_tokens(folder / "data", "train", run.length), run.length, run.seed)
    targets = batch.next(run.batch).targets.flatten().tolist()
    first_bytes = sum(len(vocabulary.decode([t])) for t in targets)
    expected = first["loss"] * len(targets) / first_bytes / math.log(2)
    assert math.isclose(first["bits_per_byte"], expected, rel_tol=1e-12)
    if tokenizer == "bytes":  # exactly the figure of a loss per byte-token
        assert evaluation["val_bits_per_byte"] == evaluation["val_loss"] / math.log(2)
        assert first["bits_per_byte"] == first["loss"] / math.log(2)
    else:
        assert covered > 2 * len(targets) * run.eval_batches  # tokens of several bytes


def test_sample_encodes_and_decodes_with_the_run_s_tokenizer(bpe_run, capsys):
    assert main(["sample", str(bpe_run), "--prompt", " héllo", "--max-new-tokens", "6",
                 "--temperature", "0"]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    model, _tokenizer, _step = load_run(bpe_run)
    tokenizer = load_tokenizer(bpe_run)
    prompt = tokenizer.encode(" héllo".encode())
    assert len(prompt) == 1  # " héllo" is one token of the corpus's BPE
    drawn = model.generate(torch.tensor([prompt]), 6, temperature=0.0)  # (1, 7)
    assert printed == tokenizer.decode(drawn[0].tolist()).decode("utf-8", errors="replace") + "\n"
    with pytest.raises(ValueError, match="has 256 tokens and the model 300"):
        generate_text(model, "def", 2, tokenizer=ByteTokenizer())


def test_a_resumed_bpe_run_repeats_the_uninterrupted_losses(bpe_run, tmp_path):
    folder = tmp_path / "resumed"
    shutil.copytree(bpe_run, folder)
    for path in folder.glob("checkpoint-0000004.pt"):
        path.unlink()  # as if the run had stopped after step 2
    model_config, run = resolve(model={}, run={}, resume=folder)
    assert (run.tokenizer, model_config.vocab_size) == ("bpe", VOCAB)
    train(model_config, run, folder, resume=True, progress=False)
    losses = {r["step"]: r["loss"] for r in records(folder, "train_step")}
    assert losses == {r["step"]: r["loss"] for r in records(bpe_run, "train_step")}


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--tokenizer", "bytes"], "run.tokenizer: 'bpe' in the run, 'bytes' now"),
        (["--vocab-size", "320"], "model.vocab_size: 300 in the run, 320 now"),
    ],
)
def test_resume_refuses_another_tokenizer(bpe_run, tmp_path, capsys, flags, named):
    folder = tmp_path / "run"
    shutil.copytree(bpe_run, folder)
    assert main(["train", "--out", str(folder), "--resume", "--steps", "6", *flags]) == 2
    error = capsys.readouterr().err
    assert named in error and error.count("\n") == 1


def test_a_folder_whose_tokenizer_is_gone_is_refused_everywhere(bpe_run, tmp_path, capsys):
    """Resume, load_run, sample and export name both sizes rather than read bytes."""
    folder = tmp_path / "run"
    shutil.copytree(bpe_run, folder)
    (folder / TOKENIZER_FILE).unlink()  # the folder would read as a byte run
    sizes = rf"vocabulary of {VOCAB} tokens but .* bytes \(256\)"
    model_config, run = resolve(run={"steps": 6}, resume=folder)
    with pytest.raises(ValueError, match=sizes):
        train(model_config, run, folder, resume=True, progress=False)
    with pytest.raises(ValueError, match=sizes):
        load_run(folder)
    for verb in (
        ["sample", str(folder), "--prompt", "x"],
        ["export", str(folder), str(tmp_path / "out")],
    ):
        assert main(verb) == 2
        error = capsys.readouterr().err
        assert re.search(sizes, error) and error.count("\n") == 1, error
    assert not (tmp_path / "out").exists()


def test_packed_rows_of_bpe_tokens_keep_to_their_documents(bpe_run):
    """Each row's runs of one document id are token runs of that one document."""
    tokens = load_tokens(bpe_run / "data", "train", 1)
    starts = load_starts(bpe_run / "data", "train")
    documents = split_documents(bpe_run, "train")
    tokenizer = load_tokenizer(bpe_run)
    batch = PackedBatches(tokens, 16, 0, starts).next(64)
    for inputs, ids in zip(batch.inputs, batch.document_ids, strict=True):
        for document in ids.unique().tolist():
            if document == len(documents):  # past the last document: padding of nothing
                continue
            piece = tokenizer.decode(inputs[ids == document].tolist())
            assert piece in documents[document]
    assert (batch.document_ids[:, 1:] != batch.document_ids[:, :-1]).any()  # rows hold several


def test_a_single_file_s_head_gets_no_end_of_text(tmp_path):
    """The head of one file held out at its tail is no document's end; the tail is."""
    corpus = tmp_path / "one.txt"
    corpus.write_text("".join(WORDS * 40))
    folder = tmp_path / "run"
    train(*configs(corpus, {"vocab_size": 270}, steps=1, val_share=0.2), folder, progress=False)
    end = load_tokenizer(folder).end_token
    train_tokens = load_tokens(folder / "data", "train", 1)
    val_tokens = load_tokens(folder / "data", "val", 1)
    assert not (train_tokens == end).any()
    assert (val_tokens == end).nonzero().flatten().tolist() == [len(val_tokens) - 1]


def greedy_rows(model, prompt, count):
    """Greedy continuations of each prompt row on its own ``(B, count)``, no end token."""
    return torch.cat([model.generate(row[None], count)[:, prompt.shape[1] :] for row in prompt])


def test_generation_stops_each_row_at_the_end_token():
    """A row that draws the end token repeats it; generation stops when every row has."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=8, width=16, n_layers=1, n_heads=2, tied_head=False)
    model = OctLM(config).eval()
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 0, 1]])  # (3, 3)
    free = greedy_rows(model, prompt, 20)  # (3, 20)
    end = int(free[0, 2])  # the first row draws it third
    first = [row.tolist().index(end) if end in row else None for row in free]
    got = model.generate(prompt, 20, end_token=end)[:, 3:]  # (3, n)
    length = 20 if None in first else max(first) + 1
    assert got.shape == (3, length)
    for row, place in zip(range(3), first, strict=True):
        cut = length if place is None else place + 1
        assert torch.equal(got[row, :cut], free[row, :cut])
        assert (got[row, cut:] == end).all()


class EndingBytes(ByteTokenizer):
    """Bytes, with one of them taken as the end of text."""

    def __init__(self, end: int):
        self.end_token = end


def test_sampled_text_stops_at_the_end_token_unless_told_to_go_on():
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=256, width=16, n_layers=1, n_heads=2, tied_head=False)
    model = OctLM(config).eval()
    free = greedy_rows(model, torch.tensor([list(b"def ")]), 30)[0].tolist()
    end = free[10]
    place = free.index(end)
    assert end not in b"def " and free.count(end) > 1  # it ends the text, and comes again
    ending = EndingBytes(end)
    text = generate_text(model, "def ", 30, tokenizer=ending)
    assert text == "def " + bytes(free[:place]).decode(errors="replace")
    went_on = generate_text(model, "def ", 30, tokenizer=ending, stop=False)
    pieces = [bytes(free[:place]), *bytes(free[place + 1 :]).split(bytes([end]))]
    assert went_on == "def " + b"<|endoftext|>".join(pieces).decode(errors="replace")


def test_a_run_without_an_end_token_says_so(bpe_run, tmp_path, capsys):
    """A BPE run whose tokenizer has no end token (its last id a plain token) resumes, samples
    and exports without one, and says so; a byte run too."""
    folder = tmp_path / "old"
    shutil.copytree(bpe_run, folder)
    spec = json.loads((folder / TOKENIZER_FILE).read_text())
    spec["model"]["vocab"]["ĠĠĠĠĠĠĠĠĠĠĠĠ"] = spec["added_tokens"].pop()["id"]
    (folder / TOKENIZER_FILE).write_text(json.dumps(spec))
    assert load_tokenizer(folder).end_token is None
    model_config, run = resolve(run={"steps": 6}, resume=folder)
    assert train(model_config, run, folder, resume=True, progress=False).step == 6
    assert main(["sample", str(folder), "--prompt", "def", "--max-new-tokens", "5"]) == 0
    assert "no end-of-text token (a BPE run whose tokenizer has none)" in capsys.readouterr().err
    assert main(["export", str(folder), str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    tokenizer_config = json.loads((tmp_path / "out" / "tokenizer_config.json").read_text())
    assert config["eos_token_id"] is None and "eos_token" not in tokenizer_config


def test_a_packed_bpe_run_trains(corpus, tmp_path):
    outcome = train(
        *configs(corpus, {"attention": "tiled"}, pack=True), tmp_path / "run", progress=False
    )
    assert outcome.step == 4 and math.isfinite(outcome.val_bits_per_byte)


@pytest.mark.parametrize(
    "model, run, message",
    [
        ({"vocab_size": 300}, {"tokenizer": "bytes"}, "byte tokens need vocab_size 256, got 300"),
        ({"vocab_size": 256}, {}, "BPE vocab_size must be above 256"),
        ({}, {"tokenizer": "words"}, r"tokenizer must be one of \('auto', 'bytes', 'bpe'\)"),
    ],
)
def test_a_vocabulary_that_is_not_the_tokenizer_s_is_refused(corpus, model, run, message):
    with pytest.raises(ValueError, match=message):
        configs(corpus, model, **run)


def test_a_start_whose_corpus_cannot_give_the_vocabulary_leaves_nothing(corpus, tmp_path):
    folder = tmp_path / "run"
    with pytest.raises(ValueError, match=r"yields only .* use a vocab_size of at most"):
        train(*configs(corpus, {"vocab_size": 5000}), folder, progress=False)
    # marked as a failed start (cleared by the next), beside the run lock's file
    assert sorted(p.name for p in folder.iterdir()) == [".octlm-lock", ".octlm-preparing"]
    outcome = train(*configs(corpus), folder, progress=False)
    assert outcome.step == 4 and (folder / TOKENIZER_FILE).is_file()


def test_the_tokenizer_file_is_the_run_s_own(bpe_run, tmp_path):
    """--overwrite may clear a BPE run (tokenizer.json is octlm's), and writes it again."""
    folder = tmp_path / "run"
    shutil.copytree(bpe_run, folder)
    train(*configs(bpe_run.parent / "corpus", steps=1), folder, overwrite=True, progress=False)
    again = BPETokenizer.from_file(folder / TOKENIZER_FILE)
    text = (bpe_run.parent / "corpus" / "part1" / "doc5.txt").read_bytes()
    assert again.encode(text) == load_tokenizer(bpe_run).encode(text)  # the same training


def test_a_corpus_too_small_for_a_bpe_asked_for_is_told_what_to_pass(corpus, tmp_path, capsys):
    """A BPE of 4,096 tokens asked for on a few kilobytes: one line naming the sizes and both
    ways out, and the same command with --tokenizer bytes trains."""
    flags = ["train", "--data", str(corpus), "--out", str(tmp_path / "run"), "--steps", "1"]
    flags += ["--width", "16", "--n-layers", "1", "--n-heads", "2", "--length", "16"]
    flags += ["--eval-batches", "1", "--sample-tokens", "4", "--batch", "4"]
    assert main([*flags, "--tokenizer", "bpe"]) == 2
    *_status, error = capsys.readouterr().err.strip().splitlines()
    assert re.match(r"octlm train: --vocab-size 4096: the training text yields only \d+ ", error)
    assert "--tokenizer bytes" in error
    assert main([*flags, "--tokenizer", "bytes"]) == 0
