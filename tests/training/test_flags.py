"""The run's flags: one per field, the same for every verb that takes them."""

import argparse
from dataclasses import fields

from octlm.cli import build_parser
from octlm.model import ModelConfig
from octlm.training import flags
from octlm.training.config import RunConfig


def test_every_config_field_has_a_flag():
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    options = {option for action in parser._actions for option in action.option_strings}
    for cls in (ModelConfig, RunConfig):
        for field in fields(cls):
            assert "--" + field.name.replace("_", "-") in options


def test_switches_turn_either_way():
    """``--no-fsdp`` and the like: a resumed run may turn off what it was started with."""
    parser = argparse.ArgumentParser()
    flags.add_arguments(parser)
    args = parser.parse_args(["--no-fsdp", "--context-parallel", "--no-compile"])
    _model, run = flags.explicit_values(args)
    assert run == {"fsdp": False, "context_parallel": True, "compile": "off"}


def test_prepare_s_flags_are_train_s_own():
    """Every flag of ``octlm prepare`` reads as ``octlm train`` has it: name, value, help."""

    def described(verb: str) -> dict:
        parser = build_parser([verb])
        verb_parser = next(
            a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
        ).choices[verb]
        return {
            action.option_strings[0]: (action.metavar, action.choices, action.help, action.type)
            for action in verb_parser._actions
            if action.option_strings and action.dest.startswith(("run.", "model."))
        }

    prepare, train = described("prepare"), described("train")
    assert {"--data", "--glob", "--vocab-size", "--tokenizer", "--val-share"} <= set(prepare)
    for option, described_so in prepare.items():
        assert described_so == train[option], option
    assert prepare["--data"][0] == "DATA" and prepare["--vocab-size"][0] == "VOCAB_SIZE"


def test_given_names_are_the_flags_and_the_file_s_fields(tmp_path):
    file = tmp_path / "run.toml"
    file.write_text("[run]\nlength = 32\n[model]\nwidth = 64\n")
    given = flags.given_names(file, {"vocab_size": 300}, {"steps": 5})
    assert given == {"length", "width", "vocab_size", "steps"}
