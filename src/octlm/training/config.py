"""What a training run is: the model (``ModelConfig``), the run (``RunConfig``) and presets.

A run's configuration is resolved in layers, later ones winning: ``ModelConfig`` and
``RunConfig`` defaults, a named preset, a TOML or JSON file (``{"model": {...}, "run":
{...}}``, the shape of the ``config.json`` every run folder keeps), then the flags given on
the command line. The model's ``max_length`` follows the run's ``length`` unless set.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch

from octlm.attention import IMPLEMENTATIONS
from octlm.attention.registry import taking
from octlm.chatml import CHAT_TOKENS
from octlm.model import INTERCHANGEABLE, ModelConfig, is_int_at_least
from octlm.tokenizer import BYTE_VOCAB, DEFAULT_BPE_VOCAB, NAMES, check_bpe_vocab_size
from octlm.training.budget import parse_duration
from octlm.training.compiled import MODES, check_mode
from octlm.training.formats import (
    CHAT_FORMATS,
    DEFAULT_GLOB,
    DEFAULT_TOKENIZER_SAMPLE,
    Formats,
)
from octlm.training.optim import DEFAULT_OPTIMIZER, OPTIMIZERS
from octlm.training.precision import AUTO

# Each preset's SwiGLU width is 8/3 of its width rounded up to a multiple of 64, or of 256 where
# the width is one (Llama's ``multiple_of``), so that every row of every matrix fills whole
# blocks of GGUF's quantized types: 32 values for q8_0 and q4_0, 256 for the K-quants.
PRESETS: dict[str, dict] = {
    "tiny": dict(width=128, n_layers=4, n_heads=4, n_kv_heads=2, mlp_width=384),
    "small": dict(width=256, n_layers=6, n_heads=8, n_kv_heads=4, mlp_width=768),
    "base": dict(width=512, n_layers=8, n_heads=8, n_kv_heads=4, mlp_width=1536),
}
DEFAULT_PRESET = "tiny"
LOSSES = ("assistant", "all")  # the targets of a chat run
TRAINING_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CONFIG_FILE = "config.json"
# Optimizer steps of a run that sets neither --steps nor --time-budget.
DEFAULT_STEPS = 1000
# What a field meant in a config.json written before the field was stored: the default then.
PREDATED = {
    "dtype": "float32",
    "tokenizer": "bytes",
    "optimizer": "adamw",
    "muon_lr": 6e-3,
    "min_lr_ratio": 0.1,
}
# Run fields a resumed run may change: how long it goes on, and how it is watched and kept.
# Which processes run it (DDP, FSDP, context parallel, one) is the launch's choice too: every
# checkpoint is a full state dict, and how the model runs (its attention, tiles, kernel and
# dropout: ``INTERCHANGEABLE``) may change with it.
RESUMABLE = frozenset(
    {"steps", "time_budget", "device", "compile", "checkpoint_activations", "eval_every"}
    | {"checkpoint_every", "keep", "early_stop", "log_every", "prompt", "sample_tokens"}
    | {"fsdp", "context_parallel"}
)


def _option(default, help: str, **flag):
    """A RunConfig field with its command-line help (and argparse extras)."""
    return dataclasses.field(default=default, metadata={"help": help, **flag})


def _switch(help: str):
    """A RunConfig field that is off unless asked for: ``--name`` and ``--no-name`` (a resumed
    run may turn it either way)."""
    return _option(False, help, action=argparse.BooleanOptionalAction)


@dataclass
class RunConfig:
    """Everything about a run except the model: data, optimisation, precision, bookkeeping."""

    data: str | None = _option(
        None,
        "a corpus file or folder (text, JSON Lines, JSON, Parquet, Arrow; plain or .gz, .zst, "
        ".xz, .bz2), or tokens octlm prepare wrote (default: this Python's stdlib)",
    )
    glob: str | None = _option(
        None,
        "files of a --data folder, {a,b} for either (default: every format above, "
        f"{DEFAULT_GLOB}; stdlib **/*.py)",
    )
    text_field: str = _option(
        "text",
        "the field of a JSON record, or column of a Parquet or Arrow table, that holds the "
        "document (a.b: field b of field a)",
    )
    separator: str | None = _option(
        None,
        "a string that cuts text files into documents, such as '<|endoftext|>' (default: each "
        "text file is one)",
    )
    tokenizer_sample: int = _option(
        DEFAULT_TOKENIZER_SAMPLE,
        "bytes of training text a BPE learns from at most, chosen by hash (0: all of it)",
    )
    val_share: float = _option(0.1, "share of documents held out for validation")
    tokenizer: str = _option(
        AUTO,
        f"bpe: a byte-level BPE of --vocab-size tokens (default {DEFAULT_BPE_VOCAB}) trained on "
        "the training split; bytes: every byte a token, nothing to train; auto: bpe, or bytes "
        "where the run would read a small corpus many times (docs/training.md)",
        choices=(AUTO, *NAMES),
    )
    pack: bool = _switch(
        "fill each row with whole documents that attend only within themselves (documents "
        "longer than a row are cut into row-sized pieces; the rest of a row is padding)"
    )
    steps: int | None = _option(
        None, f"optimizer steps (default {DEFAULT_STEPS}; with --time-budget, no limit)"
    )
    time_budget: str | None = _option(
        None,
        "train for this much wall-clock time (90s, 10m, 1h30m; a bare number is seconds): the "
        "learning rate's cosine "
        "follows the training time used (evaluations excluded) and the run ends with an "
        "evaluation and a checkpoint once it is spent; with --steps, at whichever comes first",
    )
    batch: int = _option(16, "sequences per optimizer step, over all ranks and --accumulate")
    length: int = _option(128, "tokens per sequence")
    accumulate: int = _option(1, "micro-batches per optimizer step on each rank")
    optimizer: str = _option(
        DEFAULT_OPTIMIZER,
        "muon: Muon for the blocks' matrices, AdamW for the rest (the default where torch has "
        "torch.optim.Muon, 2.9 or later); or adamw for all",
    )
    lr: float = _option(3e-3, "peak learning rate (of the AdamW part with --optimizer muon)")
    muon_lr: float = _option(0.012, "peak learning rate of Muon's matrices (--optimizer muon)")
    min_lr_ratio: float = _option(0.0, "learning rate at the end, as a share of the peak")
    warmup: int = _option(50, "steps of linear warm-up before the cosine decay")
    weight_decay: float = _option(0.1, "weight decay of the matrices (AdamW and Muon)")
    clip: float = _option(1.0, "gradient norm clipping threshold (0: none)")
    seed: int = _option(0, "RNG seed of the weights, batches and dropout")
    dtype: str = _option(
        "auto",
        "auto: bfloat16 autocast where the CPU or GPU has bfloat16 units (AVX512-BF16, AMX, "
        "Ampere or later), float32 elsewhere; or float32, bfloat16 (autocast), float16 "
        "(autocast, CUDA)",
    )
    device: str | None = _option(None, "cpu or cuda (default: cuda when there is one)")
    compile: str = _option(
        "auto",
        "torch.compile each step's forward and loss: on, off, or auto (on CUDA, and on a CPU "
        "where a C++ compiler is found); --compile alone is on, --no-compile off",
        choices=MODES,
        nargs="?",
        const="on",
    )
    checkpoint_activations: bool = _switch("recompute each block in backward (less memory)")
    eval_every: int = _option(250, "steps between evaluations (and at the end)")
    eval_batches: int = _option(16, "fixed validation batches per evaluation")
    checkpoint_every: int = _option(250, "steps between checkpoints (and at the end)")
    keep: int = _option(
        3, "checkpoints kept: the latest ones, and the best (lowest validation loss)"
    )
    early_stop: int | None = _option(
        None,
        "end the run once this many evaluations in a row came after its best, none better "
        "(validation has risen); without it the run trains on and says so after 3",
    )
    log_every: int = _option(10, "steps between metrics.jsonl records")
    prompt: str | None = _option(
        None,
        "prompt of the sample printed at each evaluation (default: the start of the held-out text)",
    )
    sample_tokens: int = _option(96, "tokens sampled at each evaluation")
    fsdp: bool = _switch("shard parameters with FSDP2 (under torchrun)")
    context_parallel: bool = _switch("split each sequence across ranks with ring attention")
    init_from: str | None = _option(
        None,
        "an octlm run folder, or a transformers folder (Llama, Mistral, Qwen3), whose config, "
        "weights and tokenizer start the run (fine-tuning); the model flags may set only how it "
        "runs (--attention, --block, --kernel, --dropout) and --max-length",
    )
    init_step: str = _option(
        "best", "the checkpoint of an --init-from run folder: best, last, or a step it kept"
    )
    chat: bool = _switch(
        "train on conversations, one record each, rendered in ChatML (docs/chat.md); "
        "octlm finetune sets it"
    )
    chat_format: str = _option(
        "auto",
        "how --chat records hold a conversation: messages (role, content), sharegpt "
        "(conversations: from, value), prompt (prompt, completion), alpaca (instruction, "
        "input, output), or auto: each record's fields tell",
        choices=CHAT_FORMATS,
    )
    strict: bool = _switch(
        "refuse a conversation set with a bad record (by default such records are skipped, "
        "counted and the first ones named)"
    )
    loss: str = _option(
        "assistant",
        "the targets of a --chat run: assistant (what the assistant says, and its end of turn) "
        "or all (every token)",
        choices=LOSSES,
    )

    def __post_init__(self) -> None:
        self.compile = check_mode(self.compile)
        if self.steps is None and self.time_budget is None:
            self.steps = DEFAULT_STEPS
        positive = ("batch", "length", "accumulate", "eval_every", "eval_batches")
        positive += ("steps",) if self.steps is not None else ()
        positive += ("checkpoint_every", "keep", "log_every")
        positive += ("early_stop",) if self.early_stop is not None else ()
        for name in positive:
            if not is_int_at_least(getattr(self, name), 1):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("warmup", "seed", "sample_tokens", "tokenizer_sample"):
            if not is_int_at_least(getattr(self, name), 0):
                raise ValueError(f"{name} must be an integer >= 0, got {getattr(self, name)!r}")
        for field in fields(self):  # a config file could give "false" for false
            value = getattr(self, field.name)
            if field.type == "bool" and not isinstance(value, bool):
                raise ValueError(f"{field.name} must be true or false, got {value!r}")
            if field.type in ("str", "str | None") and not isinstance(value, str | None):
                raise ValueError(f"{field.name} must be a string, got {value!r}")
        if self.seed >= 2**63:  # seeds derived from it (seed + rank) must stay in int64
            raise ValueError(f"seed must be below 2**63, got {self.seed!r}")
        if self.prompt is not None:
            prompt_bytes(self.prompt)
        if self.time_budget is not None:
            parse_duration(self.time_budget)
        if self.device is not None:
            parse_device(self.device)
        for name, low, high in (("val_share", 0, 1), ("min_lr_ratio", 0, 1)):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not low <= value <= high or value == 1:
                raise ValueError(f"{name} must be in [{low}, {high}), got {value!r}")
        if self.val_share == 0:
            raise ValueError("val_share must be > 0: evaluation needs held-out documents")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {self.optimizer!r}")
        for name in ("lr", "muon_lr", "weight_decay", "clip"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.dtype not in (AUTO, *TRAINING_DTYPES):
            raise ValueError(f"dtype must be one of {(AUTO, *TRAINING_DTYPES)}, got {self.dtype!r}")
        Formats(self.text_field, self.separator)
        if self.tokenizer not in (AUTO, *NAMES):
            raise ValueError(f"tokenizer must be one of {(AUTO, *NAMES)}, got {self.tokenizer!r}")
        if self.chat_format not in CHAT_FORMATS:
            raise ValueError(f"chat_format must be one of {CHAT_FORMATS}, got {self.chat_format!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if not (self.init_step in ("best", "last") or str(self.init_step).isdigit()):
            raise ValueError(
                f"init_step must be best, last or a checkpoint's step, got {self.init_step!r}"
            )
        if self.fsdp and self.context_parallel:
            raise ValueError("fsdp and context_parallel cannot be combined: choose one")

    @property
    def budget_seconds(self) -> float | None:
        """``time_budget`` in seconds; None without one."""
        return None if self.time_budget is None else parse_duration(self.time_budget)


def parse_device(text: str) -> torch.device:
    """``text`` as a torch device, or a ValueError that says what was expected. Whether the
    machine has it is for the code that uses it to say (a resumed run may move)."""
    try:
        return torch.device(text)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:<index>', got {text!r}") from None


def local_device(text: str) -> torch.device:
    """The device ``text`` names on this machine, with an index for CUDA (the current one when
    none is given); a ValueError when it is malformed or CUDA is not there."""
    device = parse_device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {text!r}: this machine or torch build has no CUDA device")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return device


def parameter_count(config: ModelConfig) -> int:
    """Parameters of ``OctLM(config)``, from its sizes alone (no model is built): the tied
    embedding, then per layer two RMSNorm weights, the fused query/key/value projection, the
    output projection and SwiGLU's three matrices, and the final RMSNorm."""
    width, mlp = config.width, config.mlp_width
    qkv = width * (config.n_heads + 2 * config.n_kv_heads) * config.head_size
    layer = 2 * width + qkv + width * width + 3 * width * mlp
    return config.vocab_size * width + config.n_layers * layer + width


def preset_summary() -> str:
    """One line per preset with its sizes and parameter count, with the default BPE vocabulary
    and with bytes."""
    lines = []
    for name, sizes in PRESETS.items():
        bpe = parameter_count(ModelConfig(**sizes, vocab_size=DEFAULT_BPE_VOCAB))
        byte = parameter_count(ModelConfig(**sizes, vocab_size=BYTE_VOCAB))
        described = ", ".join(f"{key} {value}" for key, value in sizes.items())
        lines.append(
            f"{name}: {described}; {bpe / 1e6:.2f}M parameters with BPE {DEFAULT_BPE_VOCAB:,} "
            f"({byte / 1e6:.2f}M with --tokenizer bytes)"
        )
    return "\n".join(lines)


def read_file(path: str | Path) -> dict:
    """A configuration file's ``{"model": {...}, "run": {...}}``; TOML or JSON by extension."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config {str(path)!r} is not a file")
    try:
        if path.suffix == ".toml":
            import tomllib

            content = tomllib.loads(path.read_text())
        else:
            content = json.loads(path.read_text())
    except ValueError as error:  # JSON and TOML decode errors are ValueErrors
        raise ValueError(f"config {str(path)!r} is not valid {path.suffix[1:]}: {error}") from None
    if not isinstance(content, dict) or set(content) - {"model", "run"}:
        found = sorted(content) if isinstance(content, dict) else type(content).__name__
        raise ValueError(
            f"config {str(path)!r} may hold only 'model' and 'run' tables, got {found}"
        )
    return content


def _checked_keys(table: dict, known: set[str], where: str) -> dict:
    if not isinstance(table, dict):
        raise ValueError(f"{where}: expected a table of keys, got {type(table).__name__}")
    unknown = set(table) - known
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}; expected among {sorted(known)}")
    return table


def resolve(
    preset: str | None = None,
    file: str | Path | None = None,
    model: dict | None = None,
    run: dict | None = None,
    *,
    resume: str | Path | None = None,
) -> tuple[ModelConfig, RunConfig]:
    """Defaults, then ``preset``, then ``file``, then the explicit ``model`` and ``run`` values.

    A new run's ``--tokenizer auto`` stays ``auto`` here: it follows the corpus, which the run
    opens (:mod:`octlm.training.recipe`). A resumed run keeps what auto chose at its start.

    ``resume`` is the folder of a run to continue: its stored configuration is the file, and
    only the flags given to resume it change it. A ``preset`` or ``file`` given with it (the
    command line that started the run, rerun) is accepted where it gives the run's own values;
    a value of its own applies where a resume may change it and is refused elsewhere.
    """
    if preset is not None and preset not in PRESETS:
        raise ValueError(f"preset must be one of {tuple(PRESETS)}, got {preset!r}")
    model_fields = {f.name for f in fields(ModelConfig)}
    run_fields = {f.name for f in fields(RunConfig)}
    if resume is not None:
        stored = Path(resume) / CONFIG_FILE
        if not stored.is_file():
            raise ValueError(f"--resume: {str(resume)!r} holds no run (no {CONFIG_FILE})")
        stored_run = read_file(stored).get("run", {})
        model, run = _resumed_flags(read_file(stored), preset, file, model or {}, run or {})
        # the run keeps what auto resolved to at its start: its dtype and its tokenizer
        run = {name: value for name, value in run.items() if value != AUTO or name == "compile"}
        run = {name: value for name, value in PREDATED.items() if name not in stored_run} | run
        preset, file = None, stored
    content = read_file(file) if file is not None else {}
    given = _checked_keys(content.get("model", {}), model_fields, f"config {file} [model]")
    given = given | (model or {})
    model_values = preset_values(preset or DEFAULT_PRESET, given) | given
    run_values = _checked_keys(content.get("run", {}), run_fields, f"config {file} [run]")
    run_values = run_values | (run or {})
    run_config = RunConfig(**run_values)
    if run_config.init_from is not None and resume is None:
        if "length" not in run_values:  # rows as long as the base's context
            base = _imported_model(dataclasses.replace(run_config, length=1), preset, given)
            run_config = dataclasses.replace(run_config, length=base["max_length"])
        model_values = _imported_model(run_config, preset, given)
        run_config = imported_tokenizer(run_config, run_values)
    model_values.setdefault("max_length", run_config.length)
    if run_config.tokenizer == "bpe":
        model_values.setdefault("vocab_size", DEFAULT_BPE_VOCAB)
    elif run_config.tokenizer == "bytes" and run_config.chat:  # the bytes and the chat tokens
        model_values.setdefault("vocab_size", BYTE_VOCAB + len(CHAT_TOKENS))
    if run_config.context_parallel:
        model_values["attention"] = "ring"
    model_config = model_from_dict(model_values)
    if resume is not None:  # a departure from the run is named as such, before other rules
        check_resumable(content, model_config, run_config)
    check_compatible(model_config, run_config)
    return model_config, run_config


def _imported_model(run: RunConfig, preset: str | None, given: dict) -> dict:
    """The model values of a run that starts from ``run.init_from`` (an octlm run folder or a
    transformers folder): the folder's model, run as ``given`` says (the runtime fields:
    attention, block, kernel, dropout; and ``max_length``, which RoPE lets grow), its
    vocabulary the tokenizer's (with the chat tokens for a ``chat`` run); ValueError for a
    preset, or a given value the folder's model departs from."""
    from octlm.integrations.llama_format import read_config  # safetensors, only for this
    from octlm.training.base import is_run, tokenizer_of

    folder = run.init_from
    if preset is not None:
        raise ValueError("--init-from takes the model from the folder's config.json: drop --preset")
    values = asdict(stored_model(folder)) if is_run(folder) else read_config(folder)
    imported = asdict(model_from_dict(values))
    changeable = INTERCHANGEABLE | {"max_length"}
    runtime = {name: value for name, value in given.items() if name in changeable}
    departing = [
        f"{name}={value!r} (the folder's is {imported[name]!r})"
        for name, value in given.items()
        if name not in changeable and value != imported[name]
    ]
    if departing:
        raise ValueError(
            f"--init-from {folder!r} takes the model from the folder's config.json, which "
            f"these values depart from: {'; '.join(departing)}"
        )
    vocab_size = tokenizer_of(folder, run.chat).vocab_size
    longest = max(imported["max_length"], run.length)
    return imported | {"vocab_size": vocab_size, "max_length": longest} | runtime


def imported_tokenizer(run: RunConfig, given: dict | None = None) -> RunConfig:
    """The run as it starts from ``run.init_from``: with the folder's tokenizer (bytes, or the
    byte-level BPE its weights were trained with); ValueError for another ``--tokenizer``."""
    from octlm.training.base import tokenizer_of

    name = tokenizer_of(run.init_from).name
    if (given or {}).get("tokenizer", name) != name:
        raise ValueError(
            f"--init-from {run.init_from!r} brings its own tokenizer ({name}): drop "
            f"--tokenizer {given['tokenizer']}"
        )
    return dataclasses.replace(run, tokenizer=name)


def preset_values(preset: str, given: dict) -> dict:
    """The model values of ``preset`` beneath the ``given`` ones: its MLP width goes with its
    width, so a given width leaves the MLP width to ModelConfig's rule (8/3 of the width)."""
    values = dict(PRESETS[preset])
    if "width" in given:
        values.pop("mlp_width", None)
    return values


def _resumed_flags(stored: dict, preset, file, model: dict, run: dict) -> tuple[dict, dict]:
    """The ``model`` and ``run`` values a resume applies over the run's ``stored`` configuration:
    the flags, and what ``preset`` and ``file`` set that a resume may change. What they set
    that it may not change must be the run's own value, or a ValueError names it."""
    given = {}  # (table, field) -> (value, where it comes from)
    if preset is not None:
        given |= {
            ("model", name): (value, f"--preset {preset}")
            for name, value in preset_values(preset, model).items()
            if name != "mlp_width"  # a resumed run keeps its own; its width is checked
        }
    if file is not None:
        content = read_file(file)
        for table, dataclass_ in (("model", ModelConfig), ("run", RunConfig)):
            known = {f.name for f in fields(dataclass_)}
            values = _checked_keys(content.get(table, {}), known, f"config {file} [{table}]")
            given |= {(table, name): (value, f"--config {file}") for name, value in values.items()}
    defaults = _as_json(to_dict(ModelConfig(), RunConfig(**PREDATED)))
    changes = {"model": {}, "run": {}}
    for (table, name), (value, source) in given.items():
        if name in (model if table == "model" else run):
            continue  # the flag wins, as in a new run; check_resumable judges it
        was = stored.get(table, {}).get(name, defaults[table][name])
        if _as_json(value) == was:
            continue
        if name not in (INTERCHANGEABLE if table == "model" else RESUMABLE):
            raise ValueError(
                f"--resume: {source} sets {table}.{name} to {value!r}, and the run's "
                f"{CONFIG_FILE} has {was!r}; a resumed run keeps it"
            )
        changes[table][name] = value
    return changes["model"] | model, changes["run"] | run


def _as_json(value):
    """``value`` as JSON gives it back (tuples become lists), to compare with ``config.json``."""
    return json.loads(json.dumps(value))


def stored_model(folder: str | Path) -> ModelConfig:
    """The model config a run folder's ``config.json`` holds; ``ValueError`` if it holds none
    (naming a transformers folder as one: it loads with ``OctLM.from_pretrained``)."""
    file = Path(folder) / CONFIG_FILE
    if not Path(folder).exists():
        raise ValueError(f"run folder {str(folder)!r} does not exist")
    if not file.is_file():
        raise ValueError(f"run folder {str(folder)!r} has no {CONFIG_FILE}: not an octlm run")
    try:
        content = json.loads(file.read_text())
    except ValueError:
        content = None
    if isinstance(content, dict) and "model" not in content and "model_type" in content:
        raise ValueError(
            f"{str(folder)!r} is a transformers folder, not an octlm run folder: load it with "
            f"OctLM.from_pretrained({str(folder)!r}), or train from it with octlm train "
            f"--init-from {folder}"
        )
    table = read_file(file).get("model")
    known = {f.name for f in fields(ModelConfig)}
    return model_from_dict(_checked_keys(table, known, f"config {file} [model]"))


def single_process(config: ModelConfig) -> ModelConfig:
    """``config`` as one process runs it: an implementation that needs a process group (ring)
    runs as ``auto``, which computes the same function (tiled, or sdpa where it is faster)."""
    if IMPLEMENTATIONS[config.attention].distributed:
        return dataclasses.replace(config, attention="auto")
    return config


def model_from_dict(values: dict) -> ModelConfig:
    """A ``ModelConfig`` from JSON or TOML values (which have lists where it has tuples)."""
    if isinstance(values.get("block"), list):
        values = {**values, "block": tuple(values["block"])}
    return ModelConfig(**values)


def prompt_bytes(prompt: object) -> bytes:
    """A prompt's bytes, which the run's tokenizer encodes; ``ValueError`` unless it is
    non-empty text that UTF-8 can encode (a shell hands undecodable argument bytes over as
    lone surrogates)."""
    if not isinstance(prompt, str) or not prompt:
        raise ValueError(f"prompt must be a non-empty string, got {prompt!r}")
    try:
        return prompt.encode()
    except UnicodeEncodeError as error:
        raise ValueError(f"prompt must be UTF-8 text, got {prompt!r} ({error.reason})") from None


def check_compatible(model: ModelConfig, run: RunConfig) -> None:
    """Raise ValueError where the model and the run disagree."""
    # The model's vocabulary is the tokenizer's: a larger one could sample tokens it lacks.
    byte_vocab = BYTE_VOCAB + len(CHAT_TOKENS) * run.chat  # a chat run's bytes: chat tokens too
    if run.tokenizer == "bytes" and model.vocab_size != byte_vocab:
        raise ValueError(
            f"byte tokens need vocab_size {byte_vocab}, got {model.vocab_size} (--tokenizer bpe "
            "learns a larger vocabulary)"
        )
    if run.tokenizer == "bpe":
        check_bpe_vocab_size(model.vocab_size)
    if run.length > model.max_length:
        raise ValueError(f"length ({run.length}) exceeds max_length ({model.max_length})")
    if run.sample_tokens and model.max_length < 2:
        raise ValueError(
            f"sample_tokens ({run.sample_tokens}) needs max_length >= 2 to generate, got "
            f"{model.max_length}: raise max_length or set sample_tokens to 0"
        )
    if run.pack and model.attention not in taking("document_ids"):
        raise ValueError(
            f"--pack needs attention that takes document_ids {taking('document_ids')}, got "
            f"{model.attention!r}"
            + (" (--context-parallel runs ring attention)" if run.context_parallel else "")
        )
    if model.attention == "ring" and not run.context_parallel:
        raise ValueError(
            "attention 'ring' runs only with --context-parallel under torchrun; a context-"
            "parallel run goes on without it given another --attention (e.g. tiled)"
        )


def check_resumable(stored: dict, model: ModelConfig, run: RunConfig) -> None:
    """Raise ValueError naming every field where a resumed run departs from ``stored``.

    A field ``stored`` lacks (the run is older than the field) had its default value then.
    """
    resolved = _as_json(to_dict(model, run))
    # The stored model resolved: a field it predates gets the default its own sizes imply.
    defaults = _as_json(to_dict(model_from_dict(stored["model"]), RunConfig(**PREDATED)))
    differences = [
        f"{table}.{name}: {was!r} in the run, {value!r} now"
        for table in ("model", "run")
        for name, value in resolved[table].items()
        if name not in (RESUMABLE if table == "run" else INTERCHANGEABLE)
        and value != (was := stored[table].get(name, defaults[table][name]))
    ]
    if differences:
        raise ValueError(
            "--resume continues a run with its own configuration; these differ from its "
            f"{CONFIG_FILE}: " + "; ".join(differences)
        )


def to_dict(model: ModelConfig, run: RunConfig) -> dict:
    """The fully resolved configuration, as ``config.json`` holds it."""
    return {"model": asdict(model), "run": asdict(run)}
