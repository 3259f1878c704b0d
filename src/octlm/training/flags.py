"""The run's flags: one per ``RunConfig`` and ``ModelConfig`` field, for every verb that takes
them (``octlm train``, ``octlm prepare``, ``octlm finetune``), and the values given back.

Each flag's help and argparse extras live with its field (:mod:`octlm.training.config`); the
model's fields' help is :data:`MODEL_HELP`. Every flag defaults to unset, so that the layers of
:func:`~octlm.training.config.resolve` can tell a given value from a default.
"""

from __future__ import annotations

import argparse
from collections.abc import Collection
from dataclasses import fields
from pathlib import Path

from octlm.attention import IMPLEMENTATIONS
from octlm.model import ModelConfig
from octlm.training.config import TRAINING_DTYPES, RunConfig, read_file
from octlm.training.optim import OPTIMIZERS
from octlm.training.precision import AUTO


def add_arguments(
    parser: argparse.ArgumentParser,
    run_fields: Collection[str] | None = None,
    model_fields: Collection[str] | None = None,
) -> None:
    """One flag per ``RunConfig`` and ``ModelConfig`` field (``--n-kv-heads``), default unset;
    only those named in ``run_fields`` and ``model_fields`` where given."""
    run_group = parser.add_argument_group("run")
    for field in fields(RunConfig):
        if run_fields is not None and field.name not in run_fields:
            continue
        extras = {k: v for k, v in field.metadata.items() if k != "help"}
        help = field.metadata["help"]
        if "action" not in extras:
            extras |= {"type": field_type(field.type)}
            if "choices" not in extras:  # else argparse lists them
                extras |= {"metavar": field.name.upper()}
            help += "" if field.default is None else f" (default {field.default})"
        if field.name in ("dtype", "optimizer"):
            extras |= {
                "choices": [AUTO, *TRAINING_DTYPES] if field.name == "dtype" else list(OPTIMIZERS)
            }
            extras |= {"metavar": None}
        run_group.add_argument(
            flag(field.name), dest=f"run.{field.name}", default=None, help=help, **extras
        )
        if field.name == "compile":
            run_group.add_argument(
                "--no-compile",
                dest="run.compile",
                action="store_const",
                const="off",
                help="--compile off",
            )
    model_group = parser.add_argument_group("model (default: the preset's, else ModelConfig's)")
    for field in fields(ModelConfig):
        if model_fields is not None and field.name not in model_fields:
            continue
        if field.type == "bool":
            extras = {"action": argparse.BooleanOptionalAction}
        else:
            extras = {"type": field_type(field.type), "metavar": field.name.upper()}
        if field.name == "block":
            extras = {"type": int, "nargs": "+", "metavar": "B"}
        if field.name == "attention":
            extras = {"choices": list(IMPLEMENTATIONS)}
        model_group.add_argument(
            flag(field.name),
            dest=f"model.{field.name}",
            default=None,
            help=MODEL_HELP[field.name],
            **extras,
        )


def flag(name: str) -> str:
    """The flag of a field: ``n_kv_heads`` -> ``--n-kv-heads``."""
    return "--" + name.replace("_", "-")


# The help of each model flag (ModelConfig's fields; the model's own docstring says more).
MODEL_HELP = {
    "vocab_size": "tokens in the vocabulary (bytes: 256; BPE: the size it learns)",
    "width": "the residual stream's width (embedding size)",
    "n_layers": "transformer blocks",
    "n_heads": "query heads per block (width must be a multiple)",
    "n_kv_heads": "key/value heads (grouped-query attention; default: n_heads)",
    "max_length": "the longest sequence the model takes, in tokens (default --length); a "
    "longer one at inference is refused",
    "attention": "attention implementation (auto picks sdpa or tiled per call)",
    "block": "tiled's tile: B, or BLOCK_Q BLOCK_K",
    "kernel": "tiled's kernel: auto (Triton on CUDA when installed), pytorch or triton",
    "window": "sliding-window attention: each token sees this many (0: no window)",
    "dropout": "dropout probability in training",
    "rope_base": "rotary embedding's base",
    "tied_head": "the output head shares the embedding matrix",
    "mlp_width": "SwiGLU's hidden width (default 8/3 x width, rounded up to a multiple of 8)",
    "norm_eps": "RMSNorm's epsilon",
    "qk_norm": "RMSNorm over each head's queries and keys before RoPE (exports as Qwen3)",
}


def as_flags(message: str) -> str:
    """A configuration error as the command line says it: a leading field name becomes the
    flag that sets it (``steps must be ...`` -> ``--steps must be ...``)."""
    name, space, rest = message.partition(" ")
    known = {f.name for f in fields(RunConfig)} | {f.name for f in fields(ModelConfig)}
    return flag(name) + space + rest if name in known else message


def field_type(annotation: str):
    """The argparse type of a dataclass field annotated like ``int`` or ``str | None``."""
    for name, kind in (("int", int), ("float", float), ("str", str)):
        if annotation.split(" | ")[0] == name:
            return kind
    raise TypeError(f"no command-line type for annotation {annotation!r}")


def explicit_values(args: argparse.Namespace) -> tuple[dict, dict]:
    """The ``model`` and ``run`` values given on the command line (unset flags left out)."""
    given = {name: value for name, value in vars(args).items() if value is not None}
    model = {name[6:]: value for name, value in given.items() if name.startswith("model.")}
    run = {name[4:]: value for name, value in given.items() if name.startswith("run.")}
    if "block" in model:
        block = model["block"]
        model["block"] = block[0] if len(block) == 1 else tuple(block)
    return model, run


def given_names(file: str | Path | None, model: dict, run: dict) -> frozenset[str]:
    """The fields a user set, by flag (``model`` and ``run``, from :func:`explicit_values`) or
    in a configuration ``file``: what ``--tokenizer auto`` keeps as given."""
    content = read_file(file) if file is not None else {}
    tables = [content.get("model", {}), content.get("run", {}), model, run]
    return frozenset(name for table in tables if isinstance(table, dict) for name in table)
