"""octlm train --init-from: a run starts from a transformers folder's config and weights (its
first loss is the folder's own model's loss on that batch) and keeps its tokenizer: byte
tokens, or the folder's byte-level BPE; any other tokenizer, a preset or a size that departs
from the folder is refused before anything is written."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config  # noqa: E402

from octlm import ModelConfig, OctLM  # noqa: E402
from octlm.cli import main  # noqa: E402
from octlm.export import export_model  # noqa: E402
from octlm.integrations.llama_format import read_config  # noqa: E402
from octlm.integrations.tokenizer_files import bpe_file  # noqa: E402
from octlm.training import train  # noqa: E402
from octlm.training.batches import Batches  # noqa: E402
from octlm.training.config import RunConfig, resolve  # noqa: E402
from octlm.training.folder import DATA_FOLDER  # noqa: E402
from octlm.training.metrics import METRICS  # noqa: E402
from octlm.training.tokens import load_tokens  # noqa: E402
from tests.transformers_folders import TEXTS, rope_tolerance, train_bpe  # noqa: E402

SIZES = dict(
    vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    tie_word_embeddings=False, initializer_range=0.1,
)  # fmt: skip
RUN = dict(
    steps=1, batch=4, length=16, log_every=1, eval_every=1, eval_batches=1, checkpoint_every=1,
    sample_tokens=0, warmup=0, dtype="float32",
)  # fmt: skip

pytestmark = pytest.mark.usefixtures("one_thread")


def save_llama(folder, family=LlamaConfig, **changes):
    """A transformers model of ``family`` (its config class) with ``SIZES``, saved to ``folder``;
    its norm gains drawn from [0.5, 1.5], so that each is seen to be read."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(family(**SIZES | changes))
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_llama(tmp_path_factory.mktemp("llama"))


@pytest.fixture
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("".join(TEXTS) * 40)
    return path


@pytest.mark.parametrize("family", [LlamaConfig, Qwen3Config])
def test_the_first_loss_is_the_imported_models_loss_on_that_batch(family, corpus, tmp_path):
    changes = {"head_dim": 8} if family is Qwen3Config else {}
    llama = save_llama(tmp_path / "folder", family, **changes)
    model_config, run_config = resolve(run={**RUN, "data": str(corpus), "init_from": str(llama)})
    assert asdict(model_config) == asdict(ModelConfig(**read_config(llama)))
    train(model_config, run_config, tmp_path / "run", progress=False)
    records = map(json.loads, (tmp_path / "run" / METRICS).read_text().splitlines())
    first = next(r["loss"] for r in records if r["kind"] == "train_step" and r["step"] == 1)
    tokens = load_tokens(tmp_path / "run" / DATA_FOLDER, "train", RUN["length"])
    batch = Batches(tokens, RUN["length"], run_config.seed).next(RUN["batch"])
    theirs = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float64).eval()
    with torch.no_grad():
        logits = theirs(batch.inputs).logits  # (B, T, V)
    expected = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten()).item()
    # A log-softmax moves by at most twice the largest change of its logits.
    assert abs(first - expected) <= 2 * rope_tolerance(logits), (first, expected)
    assert not (tmp_path / "run" / "tokenizer.json").exists()  # a byte run


def test_a_byte_tokenizer_and_a_byte_level_bpe_are_taken(tmp_path):
    folder = tmp_path / "bytes"
    export_model(OctLM(ModelConfig(width=32, n_layers=1, n_heads=4)), folder)
    assert bpe_file(folder, 256) is None  # octlm's own export: ids are the bytes
    (folder / "tokenizer.json").unlink()
    assert bpe_file(folder, 256) is None  # no tokenizer and 256 tokens: bytes
    with pytest.raises(ValueError, match=r"no tokenizer.json and a vocabulary of 300"):
        bpe_file(folder, 300)
    bpe = train_bpe(tmp_path / "tokenizer.json")
    size = len(json.loads(bpe.read_text())["model"]["vocab"])
    assert bpe_file(tmp_path, size) == bpe
    with pytest.raises(ValueError, match=rf"has {size} tokens but the model's vocab_size is 999"):
        bpe_file(tmp_path, 999)


def rewrite(path, edit):
    layout = json.loads(path.read_text())
    edit(layout)
    path.write_text(json.dumps(layout))


@pytest.mark.parametrize(
    "edit, reason",
    [
        (lambda t: t.update(normalizer={"type": "Lowercase"}), "it has a normalizer"),
        (
            lambda t: t["pre_tokenizer"].update(add_prefix_space=True),
            "decoding its tokens does not give the text back",
        ),
        (lambda t: t.update(decoder={"type": "Fuse"}), "its decoder is not ByteLevel"),
        (
            lambda t: t.update(pre_tokenizer={"type": "Whitespace"}),
            "its pre-tokenizer has no ByteLevel step",
        ),
    ],
)
def test_any_other_tokenizer_is_refused_with_its_reason(tmp_path, edit, reason):
    rewrite(train_bpe(tmp_path / "tokenizer.json"), edit)
    with pytest.raises(
        ValueError, match=rf"neither a byte tokenizer nor a byte-level BPE.*{reason}"
    ):
        bpe_file(tmp_path, 300)


def test_a_word_level_tokenizer_refuses_the_run_before_its_folder_exists(
    llama, corpus, tmp_path, capsys
):
    from tokenizers import Tokenizer, models

    folder = tmp_path / "words"
    folder.mkdir()
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((llama / name).read_bytes())
    words = {f"w{i}": i for i in range(256)}
    Tokenizer(models.WordLevel(words, unk_token="w0")).save(str(folder / "tokenizer.json"))
    flags = ["--data", str(corpus), "--steps", "1", "--length", "16", "--batch", "4"]
    out = tmp_path / "run"
    assert main(["train", "--init-from", str(folder), "--out", str(out), *flags]) == 2
    assert "its model is 'WordLevel', not 'BPE'" in capsys.readouterr().err
    assert not out.exists()


def test_the_run_keeps_the_folders_bpe_tokenizer(corpus, tmp_path):
    bpe = train_bpe(tmp_path / "tokenizer.json")
    vocab = len(json.loads(bpe.read_text())["model"]["vocab"])
    save_llama(tmp_path / "bpe", vocab_size=vocab)
    (tmp_path / "bpe" / "tokenizer.json").write_bytes(bpe.read_bytes())
    model_config = ModelConfig(**read_config(tmp_path / "bpe"))
    run_config = RunConfig(**RUN, data=str(corpus), init_from=str(tmp_path / "bpe"))
    train(model_config, run_config, tmp_path / "run", progress=False)
    assert (tmp_path / "run" / "tokenizer.json").read_bytes() == bpe.read_bytes()


def test_the_model_comes_from_the_folder_and_flags_set_only_how_it_runs(llama, corpus):
    run = {**RUN, "data": str(corpus), "init_from": str(llama)}
    model_config, _ = resolve(model={"attention": "tiled", "block": 8, "width": 32}, run=run)
    assert (model_config.attention, model_config.block, model_config.width) == ("tiled", 8, 32)
    with pytest.raises(ValueError, match=r"width=64 \(the folder's is 32\); n_layers=6"):
        resolve(model={"width": 64, "n_layers": 6}, run=run)
    with pytest.raises(ValueError, match=r"--init-from takes the model from .* drop --preset"):
        resolve("small", run=run)
    with pytest.raises(ValueError, match=r"nowhere' does not exist: expected a transformers"):
        resolve(run={**run, "init_from": str(corpus.parent / "nowhere")})
    with pytest.raises(ValueError, match=r"has no config.json: not a transformers folder"):
        resolve(run={**run, "init_from": str(corpus.parent)})
