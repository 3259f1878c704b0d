"""octlm train in one process: data, configuration, schedule, the loop, checkpoints, sampling.

Runs use a model of a few thousand parameters on a few kilobytes of generated text, so each
takes about a second; what they check (exact resume, errors, records) does not depend on size.
"""

from __future__ import annotations

import argparse
import bisect
import hashlib
import itertools
import json
import math
import os
import re
import signal
import threading
import time
from array import array
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch

from octlm import load_run
from octlm.cli import main
from octlm.model import ModelConfig, OctLM
from octlm.training import checkpoint, config, data, loop, train
from octlm.training.config import RunConfig, resolve
from octlm.training.metrics import METRICS, PICTURE
from octlm.training.optim import lr_factor, make_optimizer
from octlm.training.sample import generate_text

TINY_MODEL = dict(width=16, n_layers=1, n_heads=2, n_kv_heads=1)
TINY_RUN = dict(
    steps=6, batch=4, length=16, eval_every=3, eval_batches=2, checkpoint_every=2, keep=10,
    log_every=1, sample_tokens=4, warmup=2, lr=1e-2,
)  # fmt: skip


def write_corpus(folder: Path, documents: int = 12, size: int = 600) -> Path:
    """A folder of ``documents`` text files of Python-like lines, in two sub-folders."""
    generator = torch.Generator().manual_seed(0)
    words = [b"def ", b"return ", b"self", b"(x)", b": ", b"\n    ", b"import ", b"0", b"1"]
    for index in range(documents):
        picks = torch.randint(len(words), (size,), generator=generator).tolist()
        text = b"".join(words[i] for i in picks)[:size]
        path = folder / f"part{index % 2}" / f"doc{index}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text)
    return folder


def write_short_documents(folder: Path) -> Path:
    """40 documents of 2 to 40 bytes: packed rows of 16 hold several, and padding."""
    write_corpus(folder, documents=40, size=40)
    for index, path in enumerate(sorted(folder.rglob("*.txt"))):
        path.write_bytes(path.read_bytes()[: 2 + index * 7 % 39])
    return folder


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_corpus(tmp_path / "corpus")


def configs(corpus: Path, **run) -> tuple[ModelConfig, RunConfig]:
    return resolve(model=TINY_MODEL, run={**TINY_RUN, "data": str(corpus), **run})


def read_metrics(folder: Path, kind: str) -> list[dict]:
    lines = (folder / METRICS).read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def losses(folder: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(folder, "train_step")}


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in checkpoint.listed(folder)}


# --- data -------------------------------------------------------------------------------------


def test_documents_go_whole_to_one_split_by_path_hash(corpus, tmp_path):
    summary = data.write_tokens(corpus, "**/*.txt", 0.3, tmp_path / "tokens")
    documents = data.find_documents(corpus, "**/*.txt")
    held_out = [d for d in documents if data.path_fraction(d.relative_to(corpus)) < 0.3]
    assert 0 < len(held_out) < len(documents)
    for split, chosen in (
        ("val", held_out),
        ("train", [d for d in documents if d not in held_out]),
    ):
        expected = b"".join(d.read_bytes() for d in chosen)  # sorted order, as written
        assert (tmp_path / "tokens" / f"{split}.bin").read_bytes() == expected
        assert summary[f"{split}_documents"] == len(chosen)
        assert summary[f"{split}_bytes"] == len(expected)


def test_a_file_name_that_is_not_utf8_gets_a_place_in_the_split():
    """Its bytes are hashed as they are; UTF-8 names keep the place they always had."""
    odd = Path(os.fsdecode(b"src/f\xff.txt"))
    assert 0 <= data.path_fraction(odd) < 1
    named = Path("src/é.txt")
    digest = hashlib.sha256("src/é.txt".encode()).digest()
    assert data.path_fraction(named) == int.from_bytes(digest[:8], "big") / 2**64


def test_split_does_not_depend_on_where_the_corpus_lies(corpus, tmp_path):
    moved = write_corpus(tmp_path / "elsewhere" / "copy")
    first = data.write_tokens(corpus, "**/*.txt", 0.3, tmp_path / "a")
    second = data.write_tokens(moved, "**/*.txt", 0.3, tmp_path / "b")
    assert {k: v for k, v in first.items() if k != "source"} == {
        k: v for k, v in second.items() if k != "source"
    }


@pytest.mark.parametrize("val_share", [1e-9, 0.999999999])
def test_small_corpus_still_gets_both_splits(val_share):
    relatives = [Path(f"doc{i}.txt") for i in range(3)]
    ranked = sorted(relatives, key=data.path_fraction)
    chosen = data.held_out(relatives, val_share)
    expected = {ranked[0]} if val_share < 0.5 else set(ranked[:2])
    assert chosen == expected


def test_single_file_holds_out_its_tail(tmp_path):
    text = bytes(range(256)) * 4
    (tmp_path / "one.txt").write_bytes(text)
    data.write_tokens(tmp_path / "one.txt", "**/*.txt", 0.25, tmp_path / "tokens")
    assert (tmp_path / "tokens" / "train.bin").read_bytes() == text[:768]
    assert (tmp_path / "tokens" / "val.bin").read_bytes() == text[768:]


def test_tokens_are_memory_mapped_bytes(corpus, tmp_path):
    data.write_tokens(corpus, "**/*.txt", 0.3, tmp_path / "tokens")
    tokens = data.load_tokens(tmp_path / "tokens", "train", 16)
    assert tokens.dtype == torch.uint8
    assert bytes(tokens.tolist()) == (tmp_path / "tokens" / "train.bin").read_bytes()


def test_default_corpus_is_the_standard_library():
    root, glob = data.default_corpus()
    assert (root / "os.py").is_file() and glob == "**/*.py"
    found = data.find_documents(root / "json", glob)
    assert root / "json" / "decoder.py" in found
    assert not any(data.SKIPPED_FOLDERS.intersection(p.parts) for p in found)


def test_batches_are_shifted_windows_and_resume_from_their_state(corpus, tmp_path):
    data.write_tokens(corpus, "**/*.txt", 0.3, tmp_path / "tokens")
    tokens = data.load_tokens(tmp_path / "tokens", "train", 16)
    batches = data.Batches(tokens, 16, seed=3)
    inputs, targets, document_ids = batches.next(5)  # (5, 16) each
    assert inputs.shape == targets.shape == (5, 16) and inputs.dtype == torch.int64
    assert torch.equal(inputs[:, 1:], targets[:, :-1]) and document_ids is None
    state = batches.state_dict()
    expected = batches.next(5)
    again = data.Batches(tokens, 16, seed=99)
    again.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(again.next(5)[:2], expected[:2], strict=True))


def test_evaluation_batches_span_the_split(corpus, tmp_path):
    data.write_tokens(corpus, "**/*.txt", 0.3, tmp_path / "tokens")
    tokens = data.load_tokens(tmp_path / "tokens", "val", 16)
    found = data.evaluation_batches(tokens, 16, batch=4, count=3)
    assert len(found) == 3 and all(batch.inputs.shape == (4, 16) for batch in found)
    assert torch.equal(found[0][0][0], tokens[:16].long())  # the first window starts at 0
    assert torch.equal(found[-1][1][-1], tokens[-16:].long())  # the last target is the end


def test_tokens_record_where_documents_start(corpus, tmp_path):
    data.write_tokens(corpus, "**/*.txt", 0.3, tmp_path / "tokens")
    documents = data.find_documents(corpus, "**/*.txt")
    held_out = [d for d in documents if data.path_fraction(d.relative_to(corpus)) < 0.3]
    for split, chosen in (
        ("val", held_out),
        ("train", [d for d in documents if d not in held_out]),
    ):
        sizes = [d.stat().st_size for d in chosen]
        expected = [sum(sizes[:index]) for index in range(len(sizes))]
        assert data.load_starts(tmp_path / "tokens", split).tolist() == expected


@pytest.mark.parametrize("length", [4, 7])
def test_packed_rows_hold_whole_documents_or_row_sized_pieces(length):
    # Tokens are their own positions, so every row shows where it was cut from.
    sizes = [1, 3, 9, 2, 1, 5, 17, 4, 8]  # one-token documents, and ones longer than a row
    starts = torch.tensor([sum(sizes[:i]) for i in range(len(sizes))])
    ends = [s + n for s, n in zip(starts.tolist(), sizes, strict=True)]
    tokens = torch.arange(sum(sizes))
    batches = data.PackedBatches(tokens, length, seed=0, starts=starts)
    inputs, targets, document_ids = batches.next(200)  # (200, length) each
    pieces = set()
    for row, (line, target, ids) in enumerate(zip(inputs, targets, document_ids, strict=True)):
        start = int(line[0])
        first = bisect.bisect_right(starts.tolist(), start) - 1
        assert (start - starts[first]) % length == 0 and start < ends[first] - 1, row
        pieces.add(start)
        window = [min(start + j, len(tokens) - 1) for j in range(length + 1)]
        assert line.tolist() == window[:-1]
        assert ids.tolist() == [bisect.bisect_right(ends, start + j) for j in range(length)]
        for j in range(length):  # a target counts iff it stays in a whole document (or piece)
            document = bisect.bisect_right(ends, start + j)
            whole = document == first or ends[document] <= start + length + 1
            counted = whole and start + j + 1 < ends[document]
            assert int(target[j]) == (start + j + 1 if counted else data.IGNORED), (row, j)
    expected_pieces = {
        s + k * length for s, n in zip(starts.tolist(), sizes, strict=True)
        for k in range(-(-(n - 1) // length))
    }  # fmt: skip
    assert pieces == expected_pieces  # 200 rows draw every piece of this corpus


# --- configuration and schedule ---------------------------------------------------------------


def test_every_config_field_has_a_flag():
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    flags = {option for action in parser._actions for option in action.option_strings}
    for cls in (ModelConfig, RunConfig):
        for field in fields(cls):
            assert "--" + field.name.replace("_", "-") in flags


def test_switches_turn_either_way():
    """``--no-fsdp`` and the like: a resumed run may turn off what it was started with."""
    parser = argparse.ArgumentParser()
    config.add_arguments(parser)
    args = parser.parse_args(["--no-fsdp", "--context-parallel", "--no-compile"])
    _model, run = config.explicit_values(args)
    assert run == {"fsdp": False, "context_parallel": True, "compile": False}


def test_flags_override_file_which_overrides_preset(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("[model]\nwidth = 64\nn_heads = 4\n[run]\nsteps = 7\nlength = 32\n")
    model, run = resolve("small", path, model={"n_layers": 2}, run={"steps": 9})
    assert (model.width, model.n_heads, model.n_layers) == (64, 4, 2)
    assert model.n_kv_heads == config.PRESETS["small"]["n_kv_heads"]
    assert (run.steps, run.length, model.max_length) == (9, 32, 32)
    json_path = tmp_path / "run.json"
    json_path.write_text(json.dumps(config.to_dict(model, run)))
    assert resolve(file=json_path) == (model, run)


def test_parameter_count_is_the_models():
    model_config = ModelConfig(**config.PRESETS["tiny"])
    count = sum(p.numel() for p in OctLM(model_config).parameters())
    assert config.parameter_count(model_config) == count


@pytest.mark.parametrize(
    "model, run, message",
    [
        ({}, {"steps": 0}, "steps must be a positive int, got 0"),
        ({}, {"val_share": 1.0}, "val_share must be in"),
        ({}, {"dtype": "float64"}, "dtype must be one of"),
        ({"vocab_size": 100}, {}, "byte tokens need vocab_size 256, got 100"),
        ({"vocab_size": 300}, {}, "byte tokens need vocab_size 256, got 300"),
        ({}, {"prompt": "def\udcff"}, "prompt must be UTF-8 text"),
        ({}, {"pack": "false"}, "pack must be true or false, got 'false'"),
        ({}, {"compile": 0}, "compile must be true or false, got 0"),
        ({}, {"glob": 7}, "glob must be a string, got 7"),
        ({"max_length": 8}, {"length": 16}, "length (16) exceeds max_length (8)"),
        ({"attention": "ring"}, {}, "--context-parallel"),
        ({}, {"fsdp": True, "context_parallel": True}, "cannot be combined"),
        ({}, {"pack": True, "context_parallel": True}, "takes document_ids"),
        ({}, {"prompt": ""}, "prompt must be a non-empty string, got ''"),
        ({}, {"prompt": 5}, "prompt must be a string, got 5"),
        ({}, {"seed": 10**20}, "seed must be below 2**63"),
        ({}, {"device": "foo"}, "device must be 'cpu', 'cuda' or 'cuda:<index>', got 'foo'"),
        ({"max_length": 1}, {"length": 1}, "sample_tokens (96) needs max_length >= 2"),
    ],
)
def test_bad_configuration_raises(model, run, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        resolve(model=model, run=run)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without")
def test_cuda_on_a_machine_without_it_is_a_clear_error(corpus, tmp_path):
    with pytest.raises(ValueError, match="has no CUDA device"):
        train(*configs(corpus, device="cuda"), tmp_path / "run", progress=False)


@pytest.mark.parametrize("content", ["5", '{"model": 5}', '{"run": [1]}'])
def test_config_file_of_the_wrong_shape_raises(tmp_path, content):
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=r"config .*bad\.json"):
        resolve(file=path)


def test_config_file_with_unknown_key_raises(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"model": {"widht": 8}}))
    with pytest.raises(ValueError, match="unknown keys \\['widht'\\]"):
        resolve(file=path)


def test_weight_decay_applies_to_matrices_only():
    model = OctLM(ModelConfig(**TINY_MODEL, max_length=8))
    decayed, plain = make_optimizer(model, 1e-3, 0.1).param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decayed["params"]) and all(
        p.dim() == 1 for p in plain["params"]
    )
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def test_schedule_warms_up_linearly_then_decays_to_the_floor():
    factors = [lr_factor(step, warmup=4, steps=20, min_ratio=0.1) for step in range(20)]
    assert factors[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert factors[4] == 1.0 and factors[-1] == pytest.approx(0.1)
    assert all(a > b for a, b in itertools.pairwise(factors[4:]))


# --- the loop ---------------------------------------------------------------------------------


def test_run_writes_records_picture_and_checkpoints(corpus, tmp_path):
    model_config, run = configs(corpus, keep=2)
    outcome = train(model_config, run, tmp_path / "run", progress=False)
    folder = tmp_path / "run"
    steps = read_metrics(folder, "train_step")
    assert [r["step"] for r in steps] == list(range(1, 7))
    for record in steps:
        assert record["loss"] > 0 and record["lr"] > 0 and record["grad_norm"] > 0
        assert record["tokens_per_second"] > 0 and record["peak_bytes"] > 0
        assert record["memory_metric"] == "ru_maxrss" and record["experiment"] == "train"
    evals = read_metrics(folder, "eval")
    assert [r["step"] for r in evals] == [3, 6]
    for record in evals:
        assert record["val_bits_per_byte"] == pytest.approx(record["val_loss"] / math.log(2))
        assert record["sample"].startswith(run.prompt)
    assert outcome.val_loss == evals[-1]["val_loss"] and outcome.stopped_by is None
    assert len({record["run"] for record in steps + evals}) == 1  # the launch's run id
    assert isinstance(steps[0]["run"], str)
    assert [p.name for p in checkpoint.listed(folder)] == [
        "checkpoint-0000004.pt", "checkpoint-0000006.pt"
    ]  # fmt: skip
    assert (folder / PICTURE).stat().st_size > 0
    assert resolve(file=folder / "config.json") == (model_config, run)


def test_loss_falls(corpus, tmp_path):
    model_config, run = configs(corpus, steps=30, eval_every=30, checkpoint_every=30)
    outcome = train(model_config, run, tmp_path / "run", progress=False)
    curve = losses(tmp_path / "run")
    assert curve[30] < curve[1] - 1.0
    assert outcome.val_loss < math.log(256) - 1.0  # far below a uniform guess over bytes


@pytest.mark.parametrize("pack", [False, True])
def test_resumed_run_repeats_the_uninterrupted_losses_exactly(corpus, tmp_path, pack):
    corpus = write_short_documents(tmp_path / "short") if pack else corpus
    model_config, run = configs(corpus, pack=pack)
    model_config = replace(model_config, dropout=0.1)  # dropout's RNG must resume too
    train(model_config, run, tmp_path / "whole", progress=False)
    train(model_config, run, tmp_path / "cut", progress=False)
    cut = tmp_path / "cut"
    for later in checkpoint.listed(cut)[2:]:  # as if stopped right after step 4
        later.unlink()
    if not pack:  # a run older than --pack has no such field: it resumes as unpacked
        stored = json.loads((cut / "config.json").read_text())
        del stored["run"]["pack"]
        (cut / "config.json").write_text(json.dumps(stored))
    outcome = train(model_config, run, cut, resume=True, progress=False)
    assert outcome.step == 6
    assert losses(cut) == losses(tmp_path / "whole")  # exact, float for float

    def evaluations(folder):
        return [(r["step"], r["val_loss"], r["sample"]) for r in read_metrics(folder, "eval")]

    assert evaluations(cut) == evaluations(tmp_path / "whole")


@pytest.mark.parametrize("pack", [False, True])
def test_accumulation_equals_the_whole_batch(corpus, tmp_path, pack):
    corpus = write_short_documents(tmp_path / "short") if pack else corpus
    model_config, run = configs(corpus, pack=pack)  # rows count unequal numbers of targets
    train(model_config, run, tmp_path / "whole", progress=False)
    train(model_config, replace(run, accumulate=2), tmp_path / "halves", progress=False)
    whole, halves = losses(tmp_path / "whole"), losses(tmp_path / "halves")
    assert all(math.isclose(whole[s], halves[s], rel_tol=1e-5) for s in whole)


def test_activation_checkpointing_keeps_the_losses(corpus, tmp_path):
    model_config, run = configs(corpus)
    train(model_config, run, tmp_path / "plain", progress=False)
    train(model_config, replace(run, checkpoint_activations=True), tmp_path / "re", progress=False)
    plain, recomputed = losses(tmp_path / "plain"), losses(tmp_path / "re")
    assert all(math.isclose(plain[s], recomputed[s], rel_tol=1e-6) for s in plain)


def test_bfloat16_autocast_trains_close_to_float32(corpus, tmp_path):
    model_config, run = configs(corpus)
    train(model_config, run, tmp_path / "fp32", progress=False)
    train(model_config, replace(run, dtype="bfloat16"), tmp_path / "bf16", progress=False)
    fp32, bf16 = losses(tmp_path / "fp32"), losses(tmp_path / "bf16")
    assert all(abs(fp32[s] - bf16[s]) < 0.05 * fp32[s] for s in fp32)


# --- bad input: a clear error, checkpoints left alone ----------------------------------------


@pytest.mark.parametrize(
    "case, message",
    [
        ("missing", "does not exist"),
        ("no-match", "no file matching glob"),
        ("all-empty", "every matched file is empty"),
        ("one-document", "the train split is empty"),
        ("too-short", "too few for one sequence"),
        ("float16-on-cpu", "float16 needs CUDA"),
        ("batch-split", "multiple of data-parallel ranks x accumulate"),
        ("triton-on-cpu", "kernel 'triton' runs on CUDA only"),
    ],
)
def test_bad_data_and_runs_raise(tmp_path, case, message):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    run = {"data": str(corpus)}
    if case == "missing":
        run["data"] = str(tmp_path / "nothing")
    elif case == "no-match":
        (corpus / "a.md").write_text("text")
    elif case == "all-empty":
        (corpus / "a.txt").write_text("")
    elif case == "one-document":  # a folder of one document, held out by its hash
        (corpus / "a.txt").write_text("x" * 100)
        run["val_share"] = 0.999999
    elif case == "too-short":
        write_corpus(corpus, documents=12, size=3)
    else:
        write_corpus(corpus)
        run |= {"float16-on-cpu": {"dtype": "float16"}, "batch-split": {"accumulate": 3}}.get(
            case, {}
        )
    model_config, run_config = configs(corpus, **run)
    if case == "triton-on-cpu":
        model_config = replace(model_config, attention="tiled", kernel="triton")
    with pytest.raises(ValueError, match=message):
        train(model_config, run_config, tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / config.CONFIG_FILE).exists()  # no run that cannot resume


def test_a_failed_start_leaves_a_folder_the_next_start_can_use(corpus, tmp_path):
    """A start that fails before its first step (here: documents too short for a sequence)
    leaves no configuration, so the folder is no run: started again with good data, it is
    cleared and used; no --resume or --overwrite is asked for."""
    short = write_corpus(tmp_path / "short", documents=12, size=3)
    with pytest.raises(ValueError, match="too few for one sequence"):
        train(*configs(short), tmp_path / "run", progress=False)
    assert not (tmp_path / "run" / config.CONFIG_FILE).exists()
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    with pytest.raises(ValueError, match="every matched file is empty"):
        train(*configs(empty), tmp_path / "run", progress=False)
    assert not list((tmp_path / "run").rglob("*.tmp"))
    outcome = train(*configs(corpus, steps=2), tmp_path / "run", progress=False)
    assert outcome.step == 2 and (tmp_path / "run" / config.CONFIG_FILE).is_file()


def test_a_file_as_the_run_folder_is_refused(corpus, tmp_path):
    (tmp_path / "run").write_text("mine")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        train(*configs(corpus), tmp_path / "run", progress=False)
    assert (tmp_path / "run").read_text() == "mine"


@pytest.mark.parametrize(
    "damage",
    ["truncated tokens", "no tokens", "no summary", "torn summary", "summary of nothing",
     "offsets swapped", "offsets past the end"],
)  # fmt: skip
def test_damaged_token_files_are_refused_on_resume(corpus, tmp_path, damage):
    model_config, run = configs(corpus, steps=2, pack=True)
    train(model_config, run, tmp_path / "run", progress=False)
    tokens = tmp_path / "run" / "data"
    if damage == "truncated tokens":
        content = (tokens / "train.bin").read_bytes()
        (tokens / "train.bin").write_bytes(content[: len(content) // 2])
        message = "train.bin' holds .* bytes where data.json says"
    elif damage == "no tokens":
        (tokens / "train.bin").unlink()
        message = "train.bin' is missing"
    elif damage == "no summary":
        (tokens / "data.json").unlink()
        message = "data.json' is missing"
    elif damage == "torn summary":
        (tokens / "data.json").write_text('{"train_bytes": 1')
        message = "data.json' is damaged"
    elif damage == "summary of nothing":
        (tokens / "data.json").write_text("{}")
        message = "data.json' is damaged"
    elif damage == "offsets swapped":
        offsets = array("q")
        offsets.frombytes((tokens / "train.starts.bin").read_bytes())
        offsets[1], offsets[2] = offsets[2], offsets[1]
        (tokens / "train.starts.bin").write_bytes(offsets.tobytes())
        message = "offsets must rise from 0 inside the train tokens"
    else:  # the same size, other offsets: one past the tokens
        starts = torch.frombuffer(
            bytearray((tokens / "train.starts.bin").read_bytes()), dtype=torch.int64
        )
        starts[-1] = 10**12
        (tokens / "train.starts.bin").write_bytes(starts.numpy().tobytes())
        message = "offsets must rise from 0 inside the train tokens"
    with pytest.raises(ValueError, match=message):
        train(model_config, replace(run, steps=4), tmp_path / "run", resume=True, progress=False)


@pytest.mark.filterwarnings("error::octlm.records.RecordsWarning")  # the plot reads them too
def test_resuming_a_diverged_run_keeps_its_non_finite_records(corpus, tmp_path):
    model_config, run = configs(corpus, steps=2)
    train(model_config, run, tmp_path / "run", progress=False)
    with (tmp_path / "run" / METRICS).open("a") as records:
        for step in (2, 3):  # as a diverged run writes them: NaN, after the checkpoint's step
            records.write(json.dumps({"kind": "train_step", "step": step, "loss": math.nan}))
            records.write("\n")
    train(model_config, replace(run, steps=3), tmp_path / "run", resume=True, progress=False)
    steps = [r["step"] for r in read_metrics(tmp_path / "run", "train_step")]
    assert steps == [1, 2, 2, 3]  # the NaN record of step 2 stays; step 3 is written again
    assert math.isnan(read_metrics(tmp_path / "run", "train_step")[2]["loss"])


def test_a_run_resumed_for_more_steps_follows_the_new_schedule_at_once(corpus, tmp_path):
    model_config, run = configs(corpus, steps=6, warmup=2)
    train(model_config, run, tmp_path / "run", progress=False)
    train(model_config, replace(run, steps=12), tmp_path / "run", resume=True, progress=False)
    rates = {r["step"]: r["lr"] for r in read_metrics(tmp_path / "run", "train_step")}
    for step in range(7, 13):  # step k runs with the factor of k - 1 steps done
        expected = run.lr * lr_factor(step - 1, warmup=2, steps=12, min_ratio=run.min_lr_ratio)
        assert rates[step] == pytest.approx(expected, rel=1e-6), step


def test_existing_run_folder_is_refused_then_overwritten(corpus, tmp_path):
    model_config, run = configs(corpus, steps=2)
    train(model_config, run, tmp_path / "run", progress=False)
    before = file_hashes(tmp_path / "run")
    with pytest.raises(ValueError, match=r"--resume .* or --overwrite"):
        train(model_config, run, tmp_path / "run", progress=False)
    assert file_hashes(tmp_path / "run") == before
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="clears only run folders"):
        train(model_config, run, tmp_path / "other", overwrite=True, progress=False)
    assert (tmp_path / "other" / "notes.txt").read_text() == "mine"
    train(model_config, replace(run, steps=1), tmp_path / "run", overwrite=True, progress=False)
    assert [p.name for p in checkpoint.listed(tmp_path / "run")] == ["checkpoint-0000001.pt"]


def test_resume_with_another_configuration_raises_and_keeps_checkpoints(corpus, tmp_path):
    model_config, run = configs(corpus, steps=2)
    train(model_config, run, tmp_path / "run", progress=False)
    before = file_hashes(tmp_path / "run")
    with pytest.raises(ValueError, match=r"model\.width: 16 in the run, 32 now"):
        train(replace(model_config, width=32), run, tmp_path / "run", resume=True, progress=False)
    with pytest.raises(ValueError, match=r"run\.batch: 4 in the run, 8 now"):
        train(model_config, replace(run, batch=8), tmp_path / "run", resume=True, progress=False)
    assert file_hashes(tmp_path / "run") == before


def test_resume_keeps_its_new_steps_and_refuses_to_do_nothing(corpus, tmp_path):
    """A run resumed with more steps writes them to config.json, so a plain --resume after an
    interruption goes on to them; --steps at or below the run's step is refused."""
    model_config, run = configs(corpus, steps=2)
    folder = tmp_path / "run"
    train(model_config, run, folder, progress=False)
    with pytest.raises(ValueError, match="at step 2 already and --steps is 2"):
        train(model_config, run, folder, resume=True, progress=False)
    train(model_config, replace(run, steps=4), folder, resume=True, progress=False)
    assert json.loads((folder / config.CONFIG_FILE).read_text())["run"]["steps"] == 4
    model_config, run = resolve(resume=folder)
    assert run.steps == 4


def test_an_evaluation_that_fails_loses_no_step(corpus, tmp_path, monkeypatch):
    """The step's checkpoint is written before its evaluation, so the run resumes after it."""
    model_config, run = configs(corpus, steps=4, eval_every=2, checkpoint_every=2)

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(loop, "_evaluate", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        train(model_config, run, tmp_path / "run", progress=False)
    assert [p.name for p in checkpoint.listed(tmp_path / "run")] == ["checkpoint-0000002.pt"]


def test_a_resume_that_fails_in_its_first_step_keeps_the_runs_config(corpus, tmp_path, monkeypatch):
    """config.json takes a resume's new flags only once its first step has worked, so a plain
    --resume after the failure is the run as it was."""
    model_config, run = configs(corpus, steps=2)
    folder = tmp_path / "run"
    train(model_config, run, folder, progress=False)
    before = (folder / config.CONFIG_FILE).read_text()

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(loop, "_step", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        train(model_config, replace(run, steps=5), folder, resume=True, progress=False)
    assert (folder / config.CONFIG_FILE).read_text() == before
    monkeypatch.undo()
    train(model_config, replace(run, steps=5), folder, resume=True, progress=False)
    assert json.loads((folder / config.CONFIG_FILE).read_text())["run"]["steps"] == 5


def test_checkpoints_load_under_another_attention(corpus, tmp_path):
    """Attention, tiles and kernel say how attention is computed, not what the model is: a run
    resumes, and its checkpoints load, under any of them; the width still may not change."""
    model_config, run = configs(corpus, steps=2)
    train(model_config, run, tmp_path / "run", progress=False)
    other = replace(model_config, attention="tiled", block=(8, 4), kernel="pytorch")
    checkpoint.load(checkpoint.latest(tmp_path / "run"), other)
    outcome = train(other, replace(run, steps=3), tmp_path / "run", resume=True, progress=False)
    assert outcome.step == 3
    with pytest.raises(ValueError, match="n_layers 1 \\(expected 2\\)"):
        checkpoint.load(checkpoint.latest(tmp_path / "run"), replace(other, n_layers=2))


def test_overwrite_clears_only_what_octlm_wrote(corpus, tmp_path):
    """A folder with a config.json that is not a run's (a Hugging Face model folder), or a run
    folder holding files octlm did not write, is refused by --overwrite and left whole."""
    model_config, run = configs(corpus, steps=1)
    theirs = tmp_path / "hf-model"
    (theirs / "sub").mkdir(parents=True)
    (theirs / "config.json").write_text('{"model_type": "llama"}')
    (theirs / "sub" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"has no octlm config\.json"):
        train(model_config, run, theirs, overwrite=True, progress=False)
    folder = tmp_path / "run"
    train(model_config, run, folder, progress=False)
    (folder / "analysis.ipynb").write_text("mine")
    (folder / data.SUMMARY).touch()  # a name of the data folder's, in the wrong place
    with pytest.raises(ValueError, match=r"also holds analysis\.ipynb, data\.json: move them"):
        train(model_config, run, folder, overwrite=True, progress=False)
    assert (folder / "analysis.ipynb").read_text() == "mine"
    assert (theirs / "sub" / "notes.txt").read_text() == "mine"
    assert checkpoint.latest(folder) is not None


def test_checkpoint_of_another_model_raises(corpus, tmp_path):
    model_config, run = configs(corpus, steps=2)
    train(model_config, run, tmp_path / "run", progress=False)
    with pytest.raises(ValueError, match="written for another model: n_layers 1 \\(expected 2\\)"):
        checkpoint.load(checkpoint.latest(tmp_path / "run"), replace(model_config, n_layers=2))


def flip_a_weight_bit(path: Path) -> bytes:
    """The checkpoint's bytes with one bit of its first weight flipped: still a valid file."""
    content = path.read_bytes()
    state = torch.load(path, weights_only=True)["model"]
    weight = next(value for value in state.values() if isinstance(value, torch.Tensor))
    at = content.index(weight.numpy().tobytes()[:64]) + 3
    return content[:at] + bytes([content[at] ^ 0x40]) + content[at + 1 :]


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncated", "corrupted or not an octlm checkpoint"),
        ("garbage", "corrupted or not an octlm checkpoint"),
        ("flipped bit", "corrupted: its checksum does not match"),
    ],
)
def test_corrupted_checkpoint_raises_and_is_left_alone(corpus, tmp_path, damage, message):
    model_config, run = configs(corpus, steps=2)
    train(model_config, run, tmp_path / "run", progress=False)
    latest = checkpoint.latest(tmp_path / "run")
    content = latest.read_bytes()
    damaged = {
        "truncated": lambda: content[: len(content) // 2],
        "garbage": lambda: b"\x00" * 64,
        "flipped bit": lambda: flip_a_weight_bit(latest),
    }[damage]()
    latest.write_bytes(damaged)
    before = file_hashes(tmp_path / "run")
    with pytest.raises(ValueError, match=message):
        train(model_config, replace(run, steps=4), tmp_path / "run", resume=True, progress=False)
    with pytest.raises(ValueError, match="corrupted"):
        load_run(tmp_path / "run")
    assert file_hashes(tmp_path / "run") == before


# --- signals and the command line ------------------------------------------------------------


def tiny_flags(corpus: Path, folder: Path, steps: int) -> list[str]:
    return [
        "train", "--data", str(corpus), "--out", str(folder), "--steps", str(steps),
        "--width", "16", "--n-layers", "1", "--n-heads", "2", "--batch", "4", "--length", "16",
        "--eval-every", "100000", "--checkpoint-every", "100000", "--log-every", "1",
        "--eval-batches", "1", "--sample-tokens", "4",
    ]  # fmt: skip


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM])
def test_signal_writes_a_checkpoint_and_exits_cleanly(corpus, tmp_path, capsys, signal_number):
    folder = tmp_path / "run"

    def interrupt_once_training():
        deadline = time.monotonic() + 60
        while not (folder / METRICS).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal_number)

    sender = threading.Thread(target=interrupt_once_training)
    sender.start()
    status = main(tiny_flags(corpus, folder, steps=1_000_000))
    sender.join()
    assert status == 128 + signal_number  # stopped early, as a shell reports a signal
    assert f"stopped by {signal_number.name}" in capsys.readouterr().out
    _model, _tokenizer, step = load_run(folder)
    assert 1 <= step < 1_000_000
    assert max(losses(folder)) == step


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM])
def test_signal_while_preparing_stops_at_once_and_leaves_no_run(
    corpus, tmp_path, capsys, monkeypatch, signal_number
):
    """Before the first step a signal stops the preparation where it is: no run, no
    half-written token file, exit 128 + signal; the next start begins afresh."""
    folder = tmp_path / "run"
    read_bytes, documents = Path.read_bytes, []

    def signalled(path):  # the third document read: the split files are open, half written
        documents.append(path)
        if len(documents) == 3:
            os.kill(os.getpid(), signal_number)
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", signalled)
    assert main(tiny_flags(corpus, folder, steps=2)) == 128 + signal_number
    monkeypatch.setattr(Path, "read_bytes", read_bytes)
    assert len(documents) == 3  # it stopped there
    assert "before the first step; start it again" in capsys.readouterr().err
    assert not (folder / config.CONFIG_FILE).exists() and not list(folder.rglob("*.tmp"))
    assert main(tiny_flags(corpus, folder, steps=2)) == 0


def test_a_signal_during_the_last_step_ends_nothing_early(corpus, tmp_path, monkeypatch):
    step = loop._step

    def signalled_step(*args):
        os.kill(os.getpid(), signal.SIGINT)  # the loop sees it after this step, the last
        return step(*args)

    monkeypatch.setattr(loop, "_step", signalled_step)
    outcome = train(*configs(corpus, steps=1), tmp_path / "run", progress=False)
    assert outcome.stopped_by is None and outcome.step == 1
    assert checkpoint.latest(tmp_path / "run") is not None


def test_a_folder_of_someone_elses_token_files_is_never_cleared(corpus, tmp_path):
    """Files named like octlm's own (train.bin, val.bin, data.json) in a folder octlm did not
    make are not octlm's: a plain start and --overwrite both refuse it, and leave it as it was."""
    theirs = tmp_path / "project" / "data"
    theirs.mkdir(parents=True)
    for name in ("train.bin", "val.bin", "data.json"):
        (theirs / name).write_text(f"their {name}")
    with pytest.raises(ValueError, match="is not empty"):
        train(*configs(corpus), tmp_path / "project", progress=False)
    with pytest.raises(ValueError, match="clears only run folders"):
        train(*configs(corpus), tmp_path / "project", overwrite=True, progress=False)
    # A failed start of octlm's is cleared next time, but not once someone put a file there.
    short = write_corpus(tmp_path / "short", documents=12, size=3)
    with pytest.raises(ValueError, match="too few for one sequence"):
        train(*configs(short), tmp_path / "failed", progress=False)
    (tmp_path / "failed" / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="is not empty"):
        train(*configs(corpus), tmp_path / "failed", progress=False)
    assert (tmp_path / "failed" / "notes.txt").read_text() == "mine"
    assert sorted(p.read_text() for p in theirs.iterdir()) == [
        "their data.json", "their train.bin", "their val.bin"
    ]  # fmt: skip


def test_command_line_trains_refuses_resumes_and_samples(corpus, tmp_path, capsys):
    folder = tmp_path / "run"
    assert main(tiny_flags(corpus, folder, steps=2)) == 0
    assert main(tiny_flags(corpus, folder, steps=2)) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert main(["train", "--out", str(folder), "--resume", "--width", "32"]) == 2
    assert "model.width: 16 in the run, 32 now" in capsys.readouterr().err
    assert main(["train", "--out", str(folder), "--resume", "--steps", "3"]) == 0
    assert sorted(losses(folder)) == [1, 2, 3]
    capsys.readouterr()
    assert main(["sample", str(folder), "--prompt", "def ", "--max-new-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("def ") and "step 3" in err


def test_text_generation_needs_two_positions():
    """With max_length 1 there is no room for a byte of context and the next one: a clear
    error, where the window loop once spun forever; with 2 it makes progress a byte at a time."""
    small = ModelConfig(width=16, n_layers=1, n_heads=2, max_length=1)
    with pytest.raises(ValueError, match="needs max_length >= 2"):
        generate_text(OctLM(small), "x", 3)
    assert generate_text(OctLM(small), "x", 0) == "x"
    assert len(generate_text(OctLM(replace(small, max_length=2)), "x", 5).encode()) >= 6


@pytest.mark.parametrize(
    "content", ['{"run": {}}', '{"model": {"foo": 1}}', "[1]", '{"model": {"width": "x"}}']
)
def test_a_run_folder_with_a_damaged_config_is_a_clear_error(tmp_path, content):
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(ValueError, match=r"config|width must be a positive int"):
        load_run(tmp_path)


def test_a_triton_run_samples_on_a_cpu(corpus, tmp_path):
    model_config, run = configs(corpus, steps=1)
    train(model_config, run, tmp_path / "run", progress=False)
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    stored["model"] |= {"attention": "tiled", "kernel": "triton"}  # as a GPU run writes it
    (tmp_path / "run" / "config.json").write_text(json.dumps(stored))
    model, _tokenizer, _step = load_run(tmp_path / "run")
    assert (model.config.attention, model.config.kernel) == ("tiled", "pytorch")
    assert generate_text(model, "def ", 4).startswith("def ")


def test_sample_is_the_models_own_decoding(corpus, tmp_path):
    model_config, run = configs(corpus, steps=2)
    train(model_config, run, tmp_path / "run", progress=False)
    model, _tokenizer, step = load_run(tmp_path / "run")
    assert step == 2
    state = torch.load(checkpoint.latest(tmp_path / "run"), weights_only=True)["model"]
    loaded = model.state_dict()
    assert loaded.keys() == state.keys()
    for name, saved in state.items():  # tensors, and the config the model carries beside them
        assert (
            torch.equal(loaded[name], saved)
            if isinstance(saved, torch.Tensor)
            else (loaded[name] == saved)
        )
    prompt = torch.tensor([list(b"def ")])  # (1, 4)
    expected = model.eval().generate(prompt, 6)[0].tolist()  # greedy
    assert generate_text(model, "def ", 6) == bytes(expected).decode("utf-8", errors="replace")
    drawn = [generate_text(model, "def ", 6, temperature=1.0, seed=s) for s in (1, 1, 2)]
    assert drawn[0] == drawn[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_mixed_precision_trains_and_records_allocator_peak(corpus, tmp_path, dtype):
    model_config, run = configs(corpus, device="cuda", dtype=dtype, steps=12, eval_every=12)
    outcome = train(model_config, run, tmp_path / "run", progress=False)
    curve = losses(tmp_path / "run")
    assert curve[12] < curve[1] and math.isfinite(outcome.val_loss)
    assert read_metrics(tmp_path / "run", "train_step")[-1]["memory_metric"] == "cuda_max_allocated"
    model, _tokenizer, _step = load_run(tmp_path / "run", "cuda")
    assert next(model.parameters()).is_cuda
