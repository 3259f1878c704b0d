"""octlm finetune: a byte run, a BPE run or a transformers folder fine-tuned on conversations.
The run's tokenizer is the base's with the chat tokens after its last id (or the folder's own
where it has them), each new embedding row starts as the mean of the base's rows, padded rows
are dropped, ``--step`` picks the base's checkpoint, the loss counts the assistant's tokens (or
all with ``--loss all``), and the run resumes, samples and chats like any other; ``octlm
prepare --chat`` makes a token folder of conversations that a fine-tune reuses."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from octlm import load_run
from octlm.chatml import IM_END, IM_START
from octlm.cli import main
from octlm.tokenizer import END_OF_TEXT, byte_level_tokenizer
from octlm.training import checkpoint, tokens, train
from octlm.training.batches import IGNORED, PackedBatches
from octlm.training.config import resolve
from octlm.training.folder import DATA_FOLDER
from tests.training_helpers import TINY_MODEL, TINY_RUN, losses, read_metrics, write_corpus

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTH = 32
ROWS = ("embedding.weight", "head.weight")  # one row per token
# A fine-tune of one step at learning rate 0: its checkpoint holds the weights it started from.
FROZEN = ["--steps", "1", "--lr", "0"]
FLAGS = [
    "--batch", "4", "--length", str(LENGTH), "--eval-every", "1", "--eval-batches", "1",
    "--checkpoint-every", "1", "--log-every", "1", "--sample-tokens", "4", "--dtype", "float32",
    "--optimizer", "adamw", "--warmup", "0",
]  # fmt: skip


def conversations(path: Path, count: int = 40) -> Path:
    """``count`` conversations that spell a number, some with a system message, some of two
    turns."""
    lines = []
    for i in range(count):
        messages = [{"role": "system", "content": "Spell it."}] if i % 3 == 0 else []
        messages += [{"role": "user", "content": f"spell {i}"}]
        messages += [{"role": "assistant", "content": " ".join(str(i))}]
        if i % 4 == 1:
            messages += [{"role": "user", "content": "again"}, messages[-1]]
        lines.append(json.dumps({"messages": messages}) + "\n")
    path.write_text("".join(lines))
    return path


def train_base(folder: Path, corpus: Path, model: dict | None = None, **run) -> Path:
    """A run of 2 steps, evaluated and checkpointed after each, its head untied (so that its
    rows are seen apart from the embedding's)."""
    model_config, run_config = resolve(
        model={**TINY_MODEL, "tied_head": False, **(model or {})},
        run={**TINY_RUN, "data": str(corpus), "steps": 2, "eval_every": 1,
             "checkpoint_every": 1, "sample_tokens": 0, **run},
    )  # fmt: skip
    train(model_config, run_config, folder, progress=False)
    return folder


def finetune(base: Path, data: Path, out: Path, *flags: str) -> int:
    return main(["finetune", str(base), "--data", str(data), "--out", str(out), *FLAGS, *flags])


def weights(folder: Path, step: int) -> dict[str, torch.Tensor]:
    """The model weights of a run folder's checkpoint of ``step``, read from the file."""
    return torch.load(checkpoint.path_for(folder, step), weights_only=True)["model"]


def best_step(folder: Path) -> int:
    return read_metrics(folder, "eval")[-1]["best_step"]


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return conversations(tmp_path_factory.mktemp("conversations") / "conv.jsonl")


@pytest.fixture(scope="module")
def byte_base(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("byte-base")
    return train_base(root / "base", write_corpus(root / "corpus"))


@pytest.fixture(scope="module")
def frozen(byte_base, data, tmp_path_factory) -> Path:
    """A fine-tune of the byte base (its best checkpoint) that has not moved its weights."""
    out = tmp_path_factory.mktemp("frozen") / "run"
    assert finetune(byte_base, data, out, *FROZEN) == 0
    return out


# --- a byte run ----------------------------------------------------------------------------------


def test_a_byte_run_gets_the_chat_tokens_at_256_and_257(frozen, byte_base):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(frozen / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 258
    assert [tokenizer.token_to_id(t) for t in (IM_START, IM_END)] == [256, 257]
    assert tokenizer.encode("hé\n").ids == list("hé\n".encode())  # the bytes, as they were
    stored = json.loads((frozen / "config.json").read_text())
    assert stored["model"]["vocab_size"] == 258
    run = stored["run"]
    assert (run["tokenizer"], run["chat"], run["pack"], run["loss"]) == (
        "bytes", True, True, "assistant"
    )  # fmt: skip
    assert run["init_from"] == str(byte_base)
    summary = tokens.read_summary(frozen / DATA_FOLDER)
    assert (summary["tokenizer"], summary["vocab_size"], summary["dtype"]) == (
        "bytes", 258, "uint16"
    )  # fmt: skip
    assert summary["chat"]["limit"] == LENGTH + 1 and summary["chat"]["bad"] == 0
    assert not (byte_base / "tokenizer.json").exists()  # the base is left a byte run


def test_the_new_rows_start_as_the_mean_of_the_bases_rows(frozen, byte_base):
    base = weights(byte_base, best_step(byte_base))
    start = weights(frozen, 1)  # learning rate 0: as the run began
    for name in ROWS:
        rows = base[name]  # (256, C)
        assert start[name].shape == (258, rows.shape[1])
        assert torch.equal(start[name][:256], rows)
        mean = rows.double().mean(0)  # (C,)
        torch.testing.assert_close(start[name][256:].double(), mean.expand(2, -1))
    others = [n for n, v in base.items() if isinstance(v, torch.Tensor) and n not in ROWS]
    assert others and all(torch.equal(start[n], base[n]) for n in others)


def test_a_byte_fine_tune_loads_samples_and_chats(frozen, capsys):
    model, tokenizer, step = load_run(frozen)
    assert (tokenizer.name, tokenizer.vocab_size, model.config.vocab_size, step) == (
        "bytes", 258, 258, 1
    )  # fmt: skip
    assert tokenizer.special_ids == {IM_START: 256, IM_END: 257}
    capsys.readouterr()
    assert main(["sample", str(frozen), "--prompt", "spell", "--max-new-tokens", "4"]) == 0
    assert "checkpoint of step 1" in capsys.readouterr().err
    assert main(["chat", str(frozen), "--message", "spell 7", "--max-new-tokens", "4"]) == 0


def test_the_loss_counts_only_what_the_assistant_says_or_all_with_loss_all(
    frozen, byte_base, data, tmp_path
):
    """The first step's loss is the mean over the first packed batch's targets that the mask
    keeps (all in-document ones with --loss all), of the weights the run starts from."""
    everything = tmp_path / "all"
    assert finetune(byte_base, data, everything, *FROZEN, "--loss", "all") == 0
    model = load_run(frozen, step=1).model
    counted = {}
    for run, masked in ((frozen, True), (everything, False)):
        folder = run / DATA_FOLDER
        held = tokens.load_tokens(folder, "train", LENGTH)
        starts = tokens.load_starts(folder, "train")
        supervised = tokens.load_mask(folder, "train") if masked else None
        batch = PackedBatches(held, LENGTH, 0, starts, supervised=supervised).next(4)
        with torch.no_grad():
            logits = model(batch.inputs, batch.document_ids).double()  # (B, T, V)
        expected = F.cross_entropy(
            logits.flatten(0, 1), batch.targets.flatten(), ignore_index=IGNORED
        )
        assert losses(run)[1] == pytest.approx(expected.item(), rel=1e-5), run
        counted[run] = batch.targets != IGNORED
    assert (counted[frozen] <= counted[everything]).all()
    assert counted[everything].sum() > 2 * counted[frozen].sum()
    assert json.loads((everything / "config.json").read_text())["run"]["loss"] == "all"


# --- the base's checkpoint -----------------------------------------------------------------------


@pytest.mark.parametrize(("step", "taken"), [("1", 1), ("last", 2), ("best", None)])
def test_step_picks_the_bases_checkpoint(byte_base, data, tmp_path, step, taken):
    taken = taken or best_step(byte_base)
    assert finetune(byte_base, data, tmp_path / "run", *FROZEN, "--step", step) == 0
    base, start = weights(byte_base, taken), weights(tmp_path / "run", 1)
    assert torch.equal(start["embedding.weight"][:256], base["embedding.weight"])
    other = weights(byte_base, 3 - taken)  # the base's other checkpoint, which differs
    assert not torch.equal(other["embedding.weight"], base["embedding.weight"])


@pytest.mark.parametrize(
    ("step", "said"),
    [
        ("7", r"step must be 'best', 'last' or one of the run's checkpoints \[1, 2\], got 7"),
        ("first", r"must be best, last or a checkpoint's step, got 'first'"),
    ],
)
def test_a_step_the_base_does_not_have_is_a_one_line_error(
    byte_base, data, tmp_path, capsys, step, said
):
    assert finetune(byte_base, data, tmp_path / "run", *FROZEN, "--step", step) == 2
    error = capsys.readouterr().err
    assert len(error.strip().splitlines()) == 1
    assert error.startswith("octlm finetune: ")
    assert re.search(said, error), error
    # what the refused start left is cleared by the next one
    assert finetune(byte_base, data, tmp_path / "run", *FROZEN, "--step", "1") == 0


def test_a_bad_steps_error_names_the_flag_finetune_takes(byte_base, data, tmp_path, capsys):
    """finetune's flag is --step; it has no --init-step."""
    assert finetune(byte_base, data, tmp_path / "run", *FROZEN, "--step", "first") == 2
    error = capsys.readouterr().err
    assert "--step first" in error or "--step must" in error, error


# --- resume --------------------------------------------------------------------------------------


def test_a_fine_tune_resumes_with_more_steps(byte_base, data, tmp_path):
    out = tmp_path / "run"
    assert finetune(byte_base, data, out, "--steps", "2", "--lr", "1e-2") == 0
    first = losses(out)
    assert main(["finetune", str(byte_base), "--out", str(out), "--resume", "--steps", "3"]) == 0
    found = losses(out)
    assert sorted(found) == [1, 2, 3] and {k: found[k] for k in first} == first
    assert all(math.isfinite(loss) for loss in found.values())
    assert [checkpoint.step_of(p) for p in checkpoint.listed(out)][-1] == 3
    assert json.loads((out / "config.json").read_text())["run"]["steps"] == 3
    assert load_run(out, step="last").step == 3


# --- a BPE run -----------------------------------------------------------------------------------


def test_a_bpe_run_gets_the_chat_tokens_after_its_end_of_text(data, tmp_path):
    from tokenizers import Tokenizer

    base = train_base(
        tmp_path / "base", write_corpus(tmp_path / "corpus"), {"vocab_size": 300},
        tokenizer="bpe", tokenizer_sample=0,
    )  # fmt: skip
    model_config = json.loads((base / "config.json").read_text())["model"]
    size = model_config["vocab_size"]
    was = Tokenizer.from_file(str(base / "tokenizer.json"))
    assert was.token_to_id(END_OF_TEXT) == size - 1
    out = tmp_path / "run"
    assert finetune(base, data, out, "--steps", "2", "--lr", "1e-2") == 0
    now = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert now.get_vocab_size() == size + 2
    assert [now.token_to_id(t) for t in (END_OF_TEXT, IM_START, IM_END)] == [
        size - 1, size, size + 1
    ]  # fmt: skip
    assert {t: now.token_to_id(t) for t in was.get_vocab()} == was.get_vocab()
    stored = json.loads((out / "config.json").read_text())
    assert (stored["run"]["tokenizer"], stored["model"]["vocab_size"]) == ("bpe", size + 2)
    held = tokens.load_tokens(out / DATA_FOLDER, "train", LENGTH)
    assert {size, size + 1} <= set(held.tolist()) and size - 1 not in held.tolist()
    assert sorted(losses(out)) == [1, 2]
    assert all(math.isfinite(loss) for loss in losses(out).values())


# --- a transformers folder -----------------------------------------------------------------------


def chat_folder(folder: Path, tokenizer, padding: int = 5) -> tuple[Path, int]:
    """A transformers Llama folder whose tokenizer (``tokenizer`` with the end of text and the
    chat tokens as special tokens, and a ByteLevel post-processor) has fewer tokens than its
    embedding has rows."""
    pytest.importorskip("transformers")
    from tokenizers import processors

    from tests.training.test_init_from import save_llama

    tokenizer.add_special_tokens([END_OF_TEXT, IM_START, IM_END])
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    size = tokenizer.get_vocab_size()
    save_llama(folder, vocab_size=size + padding)
    tokenizer.save(str(folder / "tokenizer.json"))
    assert json.loads((folder / "tokenizer.json").read_text())["post_processor"]["type"] == (
        "ByteLevel"
    )
    return folder, size


def test_a_transformers_folder_with_chat_tokens_keeps_them_and_drops_its_padded_rows(
    data, tmp_path
):
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    from tests.transformers_folders import train_bpe

    bpe = Tokenizer.from_file(str(train_bpe(tmp_path / "bpe.json")))
    folder, size = chat_folder(tmp_path / "llama", bpe)
    out = tmp_path / "run"
    assert finetune(folder, data, out, *FROZEN) == 0
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    stored = json.loads((out / "config.json").read_text())
    assert (stored["run"]["tokenizer"], stored["model"]["vocab_size"]) == ("bpe", size)
    theirs, start = load_file(folder / "model.safetensors"), weights(out, 1)
    assert theirs["model.embed_tokens.weight"].shape[0] == size + 5
    assert torch.equal(start["embedding.weight"], theirs["model.embed_tokens.weight"][:size])
    assert torch.equal(start["head.weight"], theirs["lm_head.weight"][:size])
    held = tokens.load_tokens(out / DATA_FOLDER, "train", LENGTH).tolist()
    ids = [bpe.token_to_id(t) for t in (IM_START, IM_END)]
    assert set(ids) <= set(held) and max(held) < size
    tokenizer = load_run(out).tokenizer
    assert [tokenizer.special_ids[t] for t in (IM_START, IM_END)] == ids


def test_a_transformers_folder_of_bytes_and_special_tokens_fine_tunes(data, tmp_path):
    """A byte-level tokenizer without merges (ids the bytes) and the end of text and chat
    tokens: 259 tokens, which reads as a tokenizer named bytes."""
    folder, size = chat_folder(tmp_path / "llama", byte_level_tokenizer())
    assert size == 259
    assert finetune(folder, data, tmp_path / "run", *FROZEN) == 0
    stored = json.loads((tmp_path / "run" / "config.json").read_text())
    assert stored["model"]["vocab_size"] == 259


# --- octlm prepare of conversations --------------------------------------------------------------


def prepare(data: Path, out: Path, *flags: str) -> int:
    return main(["prepare", "--data", str(data), "--out", str(out), "--chat", *flags])


def test_prepare_makes_a_byte_token_folder_of_conversations_with_masks(data, tmp_path, capsys):
    prepared = tmp_path / "tokens"
    assert prepare(data, prepared, "--tokenizer", "bytes", "--length", "64") == 0, (
        capsys.readouterr().err
    )
    assert {*tokens.TOKEN_FILES, *tokens.MASK_FILES, tokens.SUMMARY, "tokenizer.json"} <= {
        p.name for p in prepared.iterdir()
    }
    summary = tokens.read_summary(prepared)
    assert (summary["tokenizer"], summary["vocab_size"], summary["chat"]["limit"]) == (
        "bytes", 258, 65
    )  # fmt: skip
    for split in tokens.SPLITS:
        mask = tokens.load_mask(prepared, split)
        assert len(mask) == summary[f"{split}_tokens"] and 0 < int(mask.sum()) < len(mask)


def test_a_byte_token_folder_of_conversations_prepared_again_is_up_to_date(data, tmp_path, capsys):
    # --vocab-size 258: the vocabulary of bytes and chat tokens, which --chat needs today
    flags = ["--tokenizer", "bytes", "--vocab-size", "258", "--length", "64"]
    assert prepare(data, tmp_path / "tokens", *flags) == 0
    capsys.readouterr()
    assert prepare(data, tmp_path / "tokens", *flags) == 0
    assert "is up to date" in capsys.readouterr().err


def test_a_fine_tune_reuses_a_token_folder_of_conversations_of_its_length(
    byte_base, data, tmp_path, capsys
):
    prepared = tmp_path / "tokens"
    flags = ["--tokenizer", "bytes", "--vocab-size", "258", "--length", "64"]
    assert prepare(data, prepared, *flags) == 0
    out = tmp_path / "run"
    assert finetune(byte_base, prepared, out, *FROZEN, "--length", "64") == 0
    linked = tokens.read_summary(out / DATA_FOLDER)
    assert linked["prepared_from"] == str(prepared.resolve())
    for split in tokens.SPLITS:
        assert torch.equal(
            tokens.load_mask(out / DATA_FOLDER, split), tokens.load_mask(prepared, split)
        )
    assert (out / "tokenizer.json").read_bytes() == (prepared / "tokenizer.json").read_bytes()
    capsys.readouterr()
    assert finetune(byte_base, prepared, tmp_path / "short", *FROZEN) == 2
    assert "longer than rows of --length 32: prepare it with --length 32" in (
        capsys.readouterr().err
    )
