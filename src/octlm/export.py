"""``octlm export``: a run (at its best, last or a given checkpoint) or a model file as a
transformers folder that loads with no octlm installed, or as one GGUF file for llama.cpp.

The folder holds ``config.json``, ``generation_config.json``, ``model.safetensors`` and the
tokenizer (``tokenizer.json``, ``tokenizer_config.json``); docs/transformers.md says what maps
to what. The GGUF file (``format="gguf"``, or an ``out`` ending in ``.gguf``) holds the model
and its tokenizer; docs/llama_cpp.md says what it holds. A chat model's (its tokenizer has
``<|im_start|>`` and ``<|im_end|>``) carries ChatML, its template, and ends a reply at
``<|im_end|>``; beside its GGUF file ``NAME.gguf`` goes ``NAME.Modelfile`` for Ollama.
Either is written beside ``out`` under a hidden name and renamed into place once whole, so
``out`` is absent or complete (a GGUF file and its Modelfile both or neither): a failed or
interrupted export (a full disk, Ctrl-C, SIGTERM, SIGHUP) leaves nothing behind. Every file
is written by Python's own file calls, so a failed write is an ``OSError`` and each file's
permissions follow the umask, as any new file's do.
"""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

import torch

from octlm import signals
from octlm.chatml import CHAT_TOKENS, IM_END
from octlm.model import OctLM
from octlm.tokenizer import BYTE_VOCAB, END_OF_TEXT, TOKENIZER_FILE, BPETokenizer, load_tokenizer
from octlm.training.folder import BEST, load_model

BYTES = "bytes"  # the tokenizer of a byte model: ids are the UTF-8 bytes
FORMATS = ("transformers", "gguf")
GGUF_SUFFIX = ".gguf"
MODELFILE_SUFFIX = ".Modelfile"  # a chat model's Ollama Modelfile, beside its GGUF file
EXPORT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
QUANTIZED = ("q8_0",)  # GGUF only: gguf's own quantizer writes it
# llama.cpp's converter names (convert_hf_to_gguf.py --outtype) -> export's
OUTTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "q8_0": "q8_0"}


class Exported(NamedTuple):
    """What :func:`export` wrote: the folder (or GGUF file), the class transformers builds
    from it (or ``"GGUF llama"``, ``"GGUF qwen3"``), the checkpoint's step (None for a model
    file), the tokenizer (``"bytes"``, ``"bpe"`` or None), how the checkpoint was chosen (in
    words; None for a model file), the matrices written in float16 because a quantized type
    cannot hold their rows (llama.cpp's names), and the Ollama Modelfile written beside a chat
    model's GGUF file (None for a transformers folder or a base model)."""

    folder: Path
    architecture: str
    step: int | None
    tokenizer: str | None
    checkpoint: str | None = None
    fallbacks: tuple[str, ...] = ()
    modelfile: Path | None = None


def export(
    source: str | os.PathLike,
    out: str | os.PathLike,
    *,
    step: int | str | None = None,
    format: str | None = None,
    dtype: str | None = None,
) -> Exported:
    """Write the model of ``source`` (a run folder, or a file saved with ``OctLM.save``) to the
    new folder ``out`` (``format="transformers"``) or the new file ``out`` (``"gguf"``; the
    default when ``out`` ends in ``.gguf``); ``step`` picks a run's checkpoint: ``"best"``
    (the default: the lowest validation loss, or the last where the run records none),
    ``"last"`` or a step; ``dtype`` (float32, float16, bfloat16; q8_0 for GGUF) converts the
    weights (default: as they are for transformers, float32 for GGUF).

    A run's tokenizer goes with it (its ``tokenizer.json``, else bytes; a chat model's with its
    template, :func:`chat_ends`); a model file has bytes as its tokenizer when its vocabulary
    is 256, and none otherwise (which GGUF refuses).
    """
    if format is None:
        format = "gguf" if str(out).endswith(GGUF_SUFFIX) else "transformers"
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    types = (*EXPORT_DTYPES, *QUANTIZED) if format == "gguf" else tuple(EXPORT_DTYPES)
    if dtype is not None and dtype not in types:
        raise ValueError(f"dtype must be one of {types} for {format}, got {dtype!r}")
    check_out(out)
    source = Path(source)
    how = None
    if source.is_dir():
        model, chosen = load_model(source, step=BEST if step is None else step)
        step, how = chosen.step, chosen.how
        loaded = load_tokenizer(source)  # its size checked against the model's
        # a byte run's chat tokenizer (named bytes) goes as its own tokenizer.json
        tokenizer = source / TOKENIZER_FILE if isinstance(loaded, BPETokenizer) else BYTES
        kind = loaded.name
    elif source.is_file():
        if step is not None:
            raise ValueError(
                f"step picks a checkpoint of a run folder, and {str(source)!r} is a model file"
            )
        model = OctLM.load(source)
        tokenizer = BYTES if model.config.vocab_size == BYTE_VOCAB else None
        kind = None if tokenizer is None else BYTES
    else:
        raise ValueError(
            f"{str(source)!r} does not exist: expected a run folder or a model file saved with "
            "OctLM.save"
        )
    if format == "gguf":
        from octlm.integrations import gguf_format

        dtype = dtype or "float32"
        path = export_gguf(model, out, tokenizer=tokenizer, dtype=dtype)
        fallbacks = gguf_format.fallbacks(model.config, model.state_dict(), dtype)
        architecture = f"GGUF {gguf_format.architecture(model.config)}"
        modelfile = modelfile_path(path) if chat_ends(_special_ids(tokenizer)) else None
        return Exported(path, architecture, step, kind, how, tuple(fallbacks), modelfile)
    from octlm.integrations import llama_format

    if dtype is not None:
        model = model.to(EXPORT_DTYPES[dtype])
    folder = export_model(model, out, tokenizer=tokenizer)
    architecture = llama_format.FAMILY[llama_format.model_type(model.config)]
    return Exported(folder, architecture, step, kind, how)


def check_out(out: str | os.PathLike) -> None:
    """``ValueError`` when ``out`` cannot become a new folder or file: it lies under a file."""
    for parent in Path(out).parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(
                    f"out {str(out)!r}: {str(parent)!r} is a file, not a folder to write in"
                )
            return


def chat_ends(special: dict[str, int]) -> list[str]:
    """The special tokens that end a chat model's reply, of a tokenizer whose special tokens
    are ``special``: ``<|im_end|>``, then the end of text where it has one; none for a
    tokenizer without the chat tokens (a base model's)."""
    if not all(token in special for token in CHAT_TOKENS):
        return []
    return [IM_END] + ([END_OF_TEXT] if END_OF_TEXT in special else [])


def modelfile_path(out: str | os.PathLike) -> Path:
    """Where the Ollama Modelfile of the GGUF file ``out`` goes: ``NAME.Modelfile`` beside
    ``NAME.gguf``."""
    out = Path(out)
    return out.with_name(out.name.removesuffix(GGUF_SUFFIX) + MODELFILE_SUFFIX)


def _special_ids(tokenizer: str | os.PathLike | None) -> dict[str, int]:
    """The special tokens of ``tokenizer`` (``"bytes"``, a ``tokenizer.json``, or None) and
    their ids."""
    return {} if tokenizer in (None, BYTES) else BPETokenizer.from_file(tokenizer).special_ids


def export_model(
    model: OctLM, out: str | os.PathLike, *, tokenizer: str | os.PathLike | None = BYTES
) -> Path:
    """Write ``model`` to the new folder ``out`` as transformers' Llama (Mistral with a window,
    Qwen3 with QK-norm), weights in their dtype, with ``tokenizer``: ``"bytes"``, the path of a
    ``tokenizer.json`` (a BPE, or a chat model's), or None for no tokenizer files. Returns
    ``out``."""
    from octlm.integrations import llama_format, tokenizer_files

    out = Path(out)
    check_out(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise ValueError(f"out {str(out)!r} exists and is not an empty folder: choose a new one")
    out.parent.mkdir(parents=True, exist_ok=True)
    with signals.stop_on_signals():  # a stop removes what was staged
        staging = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.export-"))
        try:
            _permissions_of_a_new_folder(staging)
            bpe = None if tokenizer in (None, BYTES) else BPETokenizer.from_file(tokenizer)
            end = None if bpe is None else bpe.end_token
            special = {} if bpe is None else bpe.special_ids
            turn = special[IM_END] if chat_ends(special) else None
            llama_format.write(staging, model.config, model.state_dict(), end, turn)
            if tokenizer is not None:
                path = None if tokenizer == BYTES else tokenizer
                tokenizer_files.write(staging, path, model.config.max_length, special)
            for file in staging.iterdir():
                _sync(file)
            os.replace(staging, out)  # replaces an empty folder; then the folder is whole
            _sync(out.parent)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return out


def export_gguf(
    model: OctLM,
    out: str | os.PathLike,
    *,
    tokenizer: str | os.PathLike | None = BYTES,
    dtype: str = "float32",
) -> Path:
    """Write ``model`` to the new GGUF file ``out`` for llama.cpp, matrices in ``dtype``
    (float32, float16, bfloat16 or q8_0; the norms in float32, from the model's own weights),
    with ``tokenizer``: ``"bytes"`` or the path of a ``tokenizer.json`` (a BPE, or a chat
    model's). A chat model's Ollama Modelfile goes beside it (:func:`modelfile_path`), written
    with it: both or neither. Returns ``out``."""
    from octlm.integrations import gguf_format

    out = Path(out)
    gguf_format.check_exportable(model.config)
    if dtype not in gguf_format.TYPES:
        raise ValueError(f"dtype must be one of {tuple(gguf_format.TYPES)}, got {dtype!r}")
    if tokenizer is None:
        raise ValueError(
            f"a GGUF file holds its tokenizer, and this model's vocabulary of "
            f"{model.config.vocab_size} is not bytes: export its run folder instead"
        )
    check_out(out)
    if out.exists():
        raise ValueError(f"out {str(out)!r} exists: choose a new file")
    stops = chat_ends(_special_ids(tokenizer))
    modelfile = modelfile_path(out) if stops else None
    if modelfile is not None and modelfile.exists():
        raise ValueError(
            f"{str(modelfile)!r} exists, where the chat model's Ollama Modelfile goes beside "
            f"{out.name}: choose another out or remove it"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    with signals.stop_on_signals():  # a stop removes what was staged
        staged, placed = {}, []  # final path -> staging path; the finals renamed so far
        try:
            for path in (out, modelfile) if modelfile is not None else (out,):
                descriptor, name = tempfile.mkstemp(dir=out.parent, prefix=f".{path.name}.export-")
                os.close(descriptor)
                staged[path] = Path(name)
                _permissions_of_a_new_file(staged[path])
            bpe = None if tokenizer == BYTES else tokenizer
            try:
                gguf_format.write(staged[out], model.config, model.state_dict(), bpe, dtype)
                if modelfile is not None:
                    staged[modelfile].write_text(gguf_format.modelfile(out.name, stops))
            except OSError as error:  # numpy's tofile says only "N requested and 0 written"
                if error.errno is None and os.statvfs(out.parent).f_bavail == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out)) from None
                raise
            for staging in staged.values():
                _sync(staging)
            for path, staging in staged.items():
                os.replace(staging, path)
                placed.append(path)
            _sync(out.parent)
        except BaseException:
            for path in [*staged.values(), *placed]:
                path.unlink(missing_ok=True)
            raise
    return out


def _permissions_of_a_new_file(file: Path) -> None:
    """mkstemp makes a file only its owner may read; the export is an ordinary file."""
    umask = os.umask(0)
    os.umask(umask)
    file.chmod(0o666 & ~umask)


def _permissions_of_a_new_folder(folder: Path) -> None:
    """mkdtemp makes a folder only its owner may read; the export is an ordinary folder."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)


def _sync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
