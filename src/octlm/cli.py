"""``octlm verify | bench | report | prepare | train | finetune | sample | chat | export``:
argument parsing only; the work is in the library."""

from __future__ import annotations

import argparse
import functools
import importlib
import re
import signal
import sys
from collections.abc import Iterable


def _verify_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``octlm verify``: where records go, how much to run, on what."""
    from octlm.lab import verify

    parser.description = (
        "Check every attention implementation against float64 naive attention (docs/design.md, "
        "'When are two results equal') and against each other, from single calls to the whole "
        "model, its decoding and training. One records file per experiment, "
        "OUT/<date>-<experiment>.jsonl, every record tagged with this run's id; exit status 1 "
        "when any check fails."
    )
    parser.add_argument(
        "--out",
        default="runs/local",
        help="folder for the records (default runs/local; `make reference` writes runs/)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer sizes and blocks, for a quick check"
    )
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:index] (default cpu)")
    parser.add_argument(
        "--dtype",
        nargs="+",
        choices=list(verify.TESTED_DTYPES),
        dest="dtypes",
        metavar="DTYPE",
        help=f"tested dtypes, among {', '.join(verify.TESTED_DTYPES)} (default: float32 "
        "bfloat16 on CPU, float32 float16 bfloat16 on CUDA)",
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=list(verify.EXPERIMENTS),
        metavar="EXPERIMENT",
        help=f"run only these, among {', '.join(verify.EXPERIMENTS)}",
    )

    def run(args: argparse.Namespace) -> int:
        verify.check_options(args.device, args.dtypes or (), args.only or ())
        plan = verify.QUICK if args.quick else verify.FULL
        found, paths = verify.run(
            args.out, plan=plan, device=args.device, dtypes=args.dtypes, experiments=args.only
        )
        print(verify.summary(found))
        print("records:", *paths, sep="\n  ")
        failed = sum(not record["passed"] for record in found)
        if failed:
            print(f"octlm verify: {failed} of {len(found)} checks failed", file=sys.stderr)
        return 1 if failed else 0

    # ValueError: an option or an output folder that cannot be written; OSError: a full disk.
    parser.set_defaults(
        run=run,
        exits={ValueError: 2, OSError: 1},
        kept=lambda args: f"finished records are in {args.out}",
    )


def _bench_parser(parser: argparse.ArgumentParser) -> None:
    """``octlm bench SUITE``: one subcommand per suite, each with the options and run of its
    module: :mod:`octlm.lab.bench.grid_command` for a grid suite, its own for a program suite
    (:data:`octlm.lab.bench.suites.PROGRAMS`)."""
    from octlm.lab.bench import grid_command
    from octlm.lab.bench.suites import ALIASES, PROGRAMS, SUITES, SUMMARIES

    parser.description = (
        "Run a suite of measurements, each in its own process, and append one record per "
        "measurement. `octlm bench SUITE --help` tells a suite's options."
    )
    suites = parser.add_subparsers(dest="suite", required=True, metavar="SUITE")
    for name in SUITES:
        aliases = [alias for alias, target in ALIASES.items() if target == name]
        suite = suites.add_parser(name, aliases=aliases, help=SUMMARIES[name])
        suite.description = (
            f"{SUMMARIES[name].capitalize()}: every measurement in its own process, one record "
            "each, in rounds that alternate the backends. Grid options replace the suite's "
            "value in all of its grids."
        )
        grid_command.add_arguments(suite)
        run = functools.partial(grid_command.execute, parser=suite)
        # A bad option, output or device; a full disk or a failed matmul probe.
        suite.set_defaults(
            run=run, exits={ValueError: 2, OSError: 1, RuntimeError: 1}, parser=suite
        )
    for name, module in PROGRAMS.items():
        program = importlib.import_module(module)
        summary = program.__doc__.splitlines()[0]
        suite = suites.add_parser(name, help=summary, description=summary)
        program.add_arguments(suite)
        run = functools.partial(program.execute, parser=suite)
        suite.set_defaults(run=run, exits={}, parser=suite)


def _report_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``octlm report``: which records, and where the Markdown and plots go."""
    parser.description = (
        "Tables and plots from records: this machine's figures beside the baseline's, ratios "
        "within rounds and under contention, equivalence, the structure cases, auto's route, "
        "ring attention, training steps, and every plain measurement; records of different "
        "machines reported apart. Given a training run's folder (or its metrics.jsonl): that "
        "run's report (loss curve, held-out bits per byte, tokens/s, configuration)."
    )
    parser.add_argument(
        "paths",
        nargs="*",
        help="records files, or training run folders (default: runs/local/*.jsonl)",
    )
    parser.add_argument(
        "--output",
        help="the report; PNGs go beside it (default runs/local/report.md for records, "
        "RUN/report.md for one run, runs/local/training-report.md for several)",
    )

    def run(args: argparse.Namespace) -> int:
        from octlm.lab.report import write_report

        print(write_report(args.paths or None, args.output))
        return 0

    parser.set_defaults(run=run, exits={FileNotFoundError: 2, ValueError: 2, OSError: 1})


def _train_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``octlm train``: a preset or config file, and one flag per config field."""
    from octlm.training import config, flags

    parser.description = (
        "Train an octlm model on text, as bytes or as BPE tokens (--tokenizer): one process, "
        "or several under torchrun (DDP by default, --fsdp, --context-parallel). With no --data "
        "the corpus is this Python's standard library. The run folder (--out) keeps "
        "config.json, metrics.jsonl, loss.png, the token files (and tokenizer.json for BPE) "
        "and the last checkpoints."
    )
    parser.epilog = "presets (--width and friends override them):\n" + config.preset_summary()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--out", default="runs/train", help="run folder (default %(default)s)")
    parser.add_argument(
        "--preset",
        choices=list(config.PRESETS),
        help=f"model sizes (default {config.DEFAULT_PRESET})",
    )
    parser.add_argument("--config", help="TOML or JSON file with [model] and [run] tables")
    _run_folder_options(parser)
    flags.add_arguments(parser)
    _training_run(parser, lambda args: {})


def _run_folder_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resume", action="store_true", help="continue the run in --out")
    parser.add_argument(
        "--overwrite", action="store_true", help="start again in an existing run folder"
    )


def _finetune_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``octlm finetune``: the base, and ``octlm train``'s flags but those that
    would change the base's model."""
    from dataclasses import fields

    from octlm.model import INTERCHANGEABLE
    from octlm.training import flags
    from octlm.training.config import RunConfig

    parser.description = (
        "Fine-tune a model on conversations (docs/chat.md): BASE, an octlm run folder (its best "
        "checkpoint, or --step's) or a transformers folder (Llama, Mistral, Qwen3), trained "
        "on the conversations of --data, rendered in ChatML with the chat tokens added to its "
        "tokenizer where it lacks them, whole conversations packed into rows, the loss on what "
        "the assistant says; rows of the base's context unless --length says otherwise. The "
        "run folder (--out) is a run as octlm train makes it: resume, sample, chat and export "
        "it the same way."
    )
    parser.add_argument("base", help="an octlm run folder, or a transformers folder")
    parser.add_argument("--out", required=True, help="the run folder to write")
    parser.add_argument(
        "--step",
        dest="run.init_step",
        help="BASE's checkpoint when it is a run folder: best (default), last or a kept step",
    )
    _run_folder_options(parser)
    taken = {"init_from", "init_step", "chat", "pack", "tokenizer", "tokenizer_sample"}
    run_fields = {f.name for f in fields(RunConfig)} - taken
    flags.add_arguments(parser, run_fields, INTERCHANGEABLE | {"max_length"})
    parser.set_defaults(**{"run.data": None})
    _training_run(
        parser,
        lambda args: {"init_from": args.base, "chat": True, "pack": True},
        {"--init-step": "--step", "--init-from": "BASE"},
    )


def _training_run(
    parser: argparse.ArgumentParser, fixed, spelled: dict[str, str] | None = None
) -> None:
    """The run of ``octlm train`` and ``octlm finetune``: the run values the flags give, over
    which ``fixed(args)`` sets a verb's own (for a new run; a resume keeps the run's); an error
    names a flag as the verb spells it (``spelled``: a field's flag -> the verb's)."""
    from octlm.training import config, flags

    def run(args: argparse.Namespace) -> int:
        from octlm.training import train

        model_values, run_values = flags.explicit_values(args)
        resume = args.out if args.resume else None
        if resume is None:
            run_values |= fixed(args)
        file = getattr(args, "config", None)
        try:
            model_config, run_config = config.resolve(
                getattr(args, "preset", None), file, model_values, run_values, resume=resume
            )
            given = flags.given_names(file, model_values, run_values)
            outcome = train(
                model_config,
                run_config,
                args.out,
                resume=args.resume,
                overwrite=args.overwrite,
                given=given,
            )
        except ValueError as error:  # said with the flags the user typed
            said = flags.as_flags(str(error))
            for flag, spelling in (spelled or {}).items():
                said = said.replace(flag, spelling)
            raise ValueError(said) from None
        if outcome.rank == 0:
            if outcome.val_bits_per_byte is not None:
                print(
                    f"validation at step {outcome.val_step}: val loss {outcome.val_loss:.4f} "
                    f"nats per token, {outcome.val_bits_per_byte:.3f} bits per byte"
                )
            print(f"run folder: {outcome.folder} (step {outcome.step})")
        if outcome.stopped_by is None:
            return 0
        # Stopped early, with a checkpoint: 128 + the signal, as a shell reports one, so a job
        # scheduler tells it from a finished run (130 for a signal on another rank).
        stopped = getattr(signal.Signals, outcome.stopped_by, signal.SIGINT)
        return 128 + stopped

    def kept(args: argparse.Namespace) -> str:
        """Said after a stop that came before the first step (a later one ends the run)."""
        after = "its checkpoints are as they were" if args.resume else "start it again"
        return f"before the first step; {after}"

    # ValueError: a bad option, data or run folder (one in use among them); OSError: a full disk.
    parser.set_defaults(run=run, exits={ValueError: 2, OSError: 1}, kept=kept)


def _prepare_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``octlm prepare``: the corpus, how its files hold documents, the tokenizer
    and the token folder."""
    from octlm.training import config, flags

    parser.description = (
        "Tokenise a corpus once into a token folder (--out) that `octlm train --data FOLDER` "
        "reuses without tokenising again: token files, data.json (with the corpus's files, "
        "sizes and times, to notice a change) and the BPE's tokenizer.json. A folder already "
        "up to date is left as it is. One octlm prepare at a time writes a folder. "
        "--tokenizer auto chooses as octlm train with its defaults (1,000 steps of 16 x 128 "
        "tokens) would: give --tokenizer and --vocab-size to choose yourself."
    )
    parser.add_argument("--out", required=True, help="the token folder to write")
    fields = {"data", "glob", "text_field", "separator", "val_share", "tokenizer"}
    fields |= {"tokenizer_sample", "chat", "chat_format", "strict", "length"}
    flags.add_arguments(parser, fields, {"vocab_size"})

    def run(args: argparse.Namespace) -> int:
        from octlm.training import prepare
        from octlm.training.corpus import Corpus

        model_values, run_values = flags.explicit_values(args)
        try:
            model_config, run_config = config.resolve(None, None, model_values, run_values)
            found = Corpus.of(run_config)
            given = flags.given_names(None, model_values, run_values)
            made = prepare.prepare_folder(args.out, found, model_config, run_config, given)
        except ValueError as error:  # said with the flags the user typed
            raise ValueError(flags.as_flags(str(error))) from None
        print(tokens_line(made))
        print(f"token folder: {args.out} (octlm train --data {args.out})")
        return 0

    def tokens_line(made) -> str:
        from octlm.training.tokens import describe

        return describe(made.summary) + (f"\n{made.said}" if made.said else "")

    parser.set_defaults(
        run=run, exits={ValueError: 2, OSError: 1}, kept=lambda args: "no token folder written"
    )


def _sample_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``octlm sample``: the run folder, its checkpoint, the prompt and how to draw."""
    parser.description = (
        "Continue a prompt with a run folder's best checkpoint (lowest validation loss; the "
        "last where the run records none) or --step's, decoding with the KV cache (any run: "
        "one process, DDP, FSDP or context parallel)."
    )
    parser.add_argument("run_dir", help="a folder written by octlm train")
    parser.add_argument("--prompt", required=True, help="text to continue")
    _step_option(parser)
    parser.add_argument(
        "--max-new-tokens", type=int, default=256, help="tokens to generate (bytes for a byte run)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="0 is greedy (default %(default)s)"
    )
    parser.add_argument("--top-k", type=int, help="draw among the K likeliest tokens only")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed of the draw")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument(
        "--no-stop",
        dest="stop",
        action="store_false",
        help="go on past the end-of-text token (printed as <|endoftext|>) for all "
        "--max-new-tokens; by default the text stops there",
    )

    def run(args: argparse.Namespace) -> int:
        from octlm import load_run
        from octlm.training import generate_text
        from octlm.training.folder import BEST, choose

        chosen = choose(args.run_dir, BEST if args.step is None else args.step)
        model, tokenizer, step = load_run(args.run_dir, args.device, step=chosen.step)
        text = generate_text(
            model,
            args.prompt,
            args.max_new_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            seed=args.seed,
            tokenizer=tokenizer,
            stop=args.stop,
        )
        ending = (
            ""
            if tokenizer.end_token is not None
            else (
                ", no end-of-text token (a byte run)"
                if tokenizer.name == "bytes"
                else ", no end-of-text token (a BPE run whose tokenizer has none)"
            )
        )
        print(f"# {args.run_dir}, checkpoint of step {step}, {chosen.how}{ending}", file=sys.stderr)
        print(text)
        return 0

    parser.set_defaults(run=run)


def _chat_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``octlm chat``: the run folder, its checkpoint, the system message, one
    message or a conversation on stdin, and how to draw."""
    parser.description = (
        "Talk with a run's model in ChatML (a run fine-tuned on conversations: its tokenizer "
        "has the chat tokens), its best checkpoint or --step's, decoding with the KV cache. "
        "With --message: one reply, alone on stdout. Without: one user message per line of "
        "stdin, each reply streamed to stdout; /reset forgets the turns (not --system), "
        "Ctrl-D ends. The oldest turns are dropped when the model's context fills."
    )
    parser.add_argument("run_dir", help="a run folder whose tokenizer has the chat tokens")
    _step_option(parser)
    parser.add_argument("--system", help="the system message, first in the conversation")
    parser.add_argument("--message", help="one user message: print the reply and leave")
    parser.add_argument(
        "--max-new-tokens", type=int, default=256, help="most tokens of a reply (default 256)"
    )
    parser.add_argument(
        "--temperature", type=float, default=0.8, help="0 is greedy (default %(default)s)"
    )
    parser.add_argument("--top-k", type=int, help="draw among the K likeliest tokens only")
    parser.add_argument("--seed", type=int, default=0, help="RNG seed of the draws")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")

    def run(args: argparse.Namespace) -> int:
        from octlm import load_run
        from octlm.chat import CONTEXT, MAX_NEW_TOKENS, Chat
        from octlm.training.folder import BEST, choose

        chosen = choose(args.run_dir, BEST if args.step is None else args.step)
        model, tokenizer, step = load_run(args.run_dir, args.device, step=chosen.step)
        drawing = dict(temperature=args.temperature, top_k=args.top_k, seed=args.seed)
        chat = Chat(model, tokenizer, args.system, max_new_tokens=args.max_new_tokens, **drawing)
        print(f"# {args.run_dir}, checkpoint of step {step}, {chosen.how}", file=sys.stderr)
        cuts = {
            MAX_NEW_TOKENS: f"# the reply was cut at --max-new-tokens {args.max_new_tokens}",
            CONTEXT: f"# the reply was cut at the model's context, {model.config.max_length} "
            "tokens",
        }
        if args.message is not None:
            said = chat.say(args.message)
            print(said.text)
            if said.stopped in cuts:
                print(cuts[said.stopped], file=sys.stderr)
            return 0

        def write(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        while True:
            if sys.stdin.isatty():
                print("> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line:  # Ctrl-D
                return 0
            text = line.rstrip("\r\n")
            if text.strip() == "/reset":
                chat.reset()
                print("# the conversation starts again", file=sys.stderr)
                continue
            if not text.strip():
                continue
            try:
                said = chat.say(text, on_text=write)
            except ValueError as error:  # a message too long for the context: say the next
                print(f"octlm chat: {error}", file=sys.stderr)
                continue
            print(flush=True)
            if said.stopped in cuts:
                print(cuts[said.stopped], file=sys.stderr)

    # ValueError: a bad option, run folder or tokenizer without chat tokens; OSError: a closed
    # stdout.
    parser.set_defaults(run=run, exits={ValueError: 2, OSError: 1})


def _step_option(parser: argparse.ArgumentParser) -> None:
    """``--step`` of ``octlm sample``, ``octlm chat`` and ``octlm export``: best, last or a kept
    step."""
    parser.add_argument(
        "--step",
        type=lambda text: int(text) if text.isdigit() else text,
        help="the run's checkpoint: best (the default: the lowest validation loss, or the last "
        "where the run records none), last, or the step of one it kept",
    )


def _export_parser(parser: argparse.ArgumentParser) -> None:
    """Options of ``octlm export``: what to export, where, and in which type."""
    from octlm.export import EXPORT_DTYPES, FORMATS, OUTTYPES, QUANTIZED

    parser.description = (
        "Write a run's model (its best checkpoint, or --step's) or a model file saved with "
        "OctLM.save as a transformers folder: config.json, generation_config.json, "
        "model.safetensors and the tokenizer. AutoModelForCausalLM loads it as LlamaForCausalLM "
        "(MistralForCausalLM for a model with a window, Qwen3ForCausalLM for one with "
        "--qk-norm), AutoTokenizer as the run's tokenizer; "
        "octlm need not be installed there. With --format gguf (or an OUT ending in .gguf): one "
        "GGUF file with the model and its tokenizer, for llama.cpp, Ollama and LM Studio "
        "(docs/llama_cpp.md)."
    )
    parser.add_argument("source", help="a run folder written by octlm train, or a model file")
    parser.add_argument(
        "out", help="the folder (or .gguf file) to write; a folder must not exist or be empty"
    )
    _step_option(parser)
    parser.add_argument(
        "--format",
        choices=FORMATS,
        help="transformers (a folder) or gguf (one file); default: gguf for an OUT ending in "
        ".gguf, else transformers",
    )
    types = parser.add_mutually_exclusive_group()
    types.add_argument(
        "--dtype",
        choices=[*EXPORT_DTYPES, *QUANTIZED],
        help="the weights' type (default: as trained for transformers, float32 for gguf); "
        "q8_0 is gguf's 8-bit blocks; a GGUF file keeps its norms in float32",
    )
    types.add_argument(
        "--outtype",
        choices=list(OUTTYPES),
        help="--dtype by llama.cpp's converter names: "
        + ", ".join(f"{name} is {dtype}" for name, dtype in OUTTYPES.items()),
    )

    def run(args: argparse.Namespace) -> int:
        from octlm.export import export

        dtype = args.dtype or OUTTYPES.get(args.outtype)
        exported = export(args.source, args.out, step=args.step, format=args.format, dtype=dtype)
        step = ""
        if exported.step is not None:
            step = f", checkpoint of step {exported.step}, {exported.checkpoint}"
        tokenizer = exported.tokenizer or "no tokenizer (the model file's vocabulary is not bytes)"
        print(f"{exported.folder}: {exported.architecture}{step}; tokenizer {tokenizer}")
        if exported.modelfile is not None:
            name = exported.folder.stem
            print(f"for Ollama: ollama create {name} -f {exported.modelfile}")
        if exported.fallbacks:
            print(
                f"in float16, as {dtype} cannot hold their rows (a length not a multiple of its "
                f"block): {', '.join(exported.fallbacks)}"
            )
        return 0

    # A bad source, step or output folder; a full disk.
    parser.set_defaults(
        run=run,
        exits={ValueError: 2, OSError: 1},
        kept=lambda args: f"nothing written to {args.out}",
    )


class _Parser(argparse.ArgumentParser):
    """Says a command-line mistake in one line that points to --help, not a usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


# Each verb: the function that adds its options, and its one line in ``octlm --help``.
VERBS = {
    "verify": (_verify_parser, "equivalence experiments -> runs/local/*.jsonl"),
    "bench": (_bench_parser, "one process per measurement -> runs/local/"),
    "report": (_report_parser, "tables and plots from records"),
    "prepare": (_prepare_parser, "tokenise a corpus once -> a token folder for train"),
    "train": (_train_parser, "train a model -> a run folder"),
    "finetune": (_finetune_parser, "fine-tune a model on conversations -> a run folder"),
    "sample": (_sample_parser, "text from a run folder's checkpoint"),
    "chat": (_chat_parser, "talk with a run fine-tuned on conversations"),
    "export": (_export_parser, "a run or model file -> transformers folder or GGUF"),
}


def build_parser(verbs: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every verb, with the options of ``verbs`` only (default: all). A verb's
    options import what it runs, so ``octlm --help`` and ``octlm --version`` build none."""
    from octlm import __version__

    chosen = set(VERBS) if verbs is None else set(verbs)
    parser = _Parser(
        prog="octlm",
        description="Exact attention behind one signature, checked, measured, trained in an LM.",
    )
    parser.add_argument("--version", action="version", version=f"octlm {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (add_options, summary) in VERBS.items():
        verb = commands.add_parser(name, help=summary)
        verb.set_defaults(parser=verb)  # a verb's own parser reports what it does not know
        if name in chosen:
            add_options(verb)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one verb. An error it expects (``exits``: a bad option or input, 2 by default; a
    full disk, 1) is one line on stderr and that exit status, never a traceback; so are Ctrl-C
    (130), SIGTERM and SIGHUP (128 + the signal) where the verb does not say more itself.
    """
    from octlm.signals import run_stoppable

    argv = _attached_values(sys.argv[1:] if argv is None else list(argv))
    parser = build_parser(argument for argument in argv[:1] if argument in VERBS)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # said by the (sub)command that was given them, with its usage
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    exits = getattr(args, "exits", {ValueError: 2})
    kept = getattr(args, "kept", None)
    name = f"octlm {args.command}" + (f" {args.suite}" if args.command == "bench" else "")
    return run_stoppable(name, lambda: args.run(args), exits, kept(args) if kept else None)


def _attached_values(argv: list[str]) -> list[str]:
    """``--option -5m`` as ``--option=-5m``: argparse takes a value that starts with a dash
    for an option unless it is a plain negative number, and a negative duration is a value
    (refused by its option's check, with the reason)."""
    joined = []
    for argument in argv:
        if (
            joined
            and joined[-1].startswith("--")
            and re.fullmatch(r"-\d[\d.]*[a-z][\w.]*", argument)
        ):
            joined[-1] = f"{joined[-1]}={argument}"
        else:
            joined.append(argument)
    return joined


if __name__ == "__main__":
    sys.exit(main())
