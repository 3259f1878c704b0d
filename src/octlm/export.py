"""``octlm export``: a run (at its best, last or a given checkpoint) or a model file as a
transformers folder that loads with no octlm installed, or as one GGUF file for llama.cpp.

The folder holds ``config.json``, ``generation_config.json``, ``model.safetensors`` and the
tokenizer (``tokenizer.json``, ``tokenizer_config.json``); docs/transformers.md says what maps
to what. The GGUF file (``format="gguf"``, or an ``out`` ending in ``.gguf``) holds the model
and its tokenizer; docs/llama_cpp.md says what it holds. Either is written beside ``out`` under
a hidden name and renamed into place once whole, so ``out`` is absent or complete: a failed or
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
from octlm.model import OctLM
from octlm.tokenizer import BYTE_VOCAB, TOKENIZER_FILE, BPETokenizer, load_tokenizer
from octlm.training.folder import BEST, load_model

BYTES = "bytes"  # the tokenizer of a byte model: ids are the UTF-8 bytes
FORMATS = ("transformers", "gguf")
GGUF_SUFFIX = ".gguf"
EXPORT_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
QUANTIZED = ("q8_0",)  # GGUF only: gguf's own quantizer writes it
# llama.cpp's converter names (convert_hf_to_gguf.py --outtype) -> export's
OUTTYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16", "q8_0": "q8_0"}


class Exported(NamedTuple):
    """What :func:`export` wrote: the folder (or GGUF file), the class transformers builds
    from it (or ``"GGUF llama"``, ``"GGUF qwen3"``), the checkpoint's step (None for a model
    file), the tokenizer (``"bytes"``, ``"bpe"`` or None), how the checkpoint was chosen (in
    words; None for a model file), and the matrices written in float16 because a quantized type
    cannot hold their rows (llama.cpp's names)."""

    folder: Path
    architecture: str
    step: int | None
    tokenizer: str | None
    checkpoint: str | None = None
    fallbacks: tuple[str, ...] = ()


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

    A run's tokenizer goes with it (its ``tokenizer.json``, else bytes); a model file has bytes
    as its tokenizer when its vocabulary is 256, and none otherwise (which GGUF refuses).
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
        bpe = source / TOKENIZER_FILE
        tokenizer = BYTES if load_tokenizer(source).name == BYTES else bpe  # sizes checked
    elif source.is_file():
        if step is not None:
            raise ValueError(
                f"step picks a checkpoint of a run folder, and {str(source)!r} is a model file"
            )
        model = OctLM.load(source)
        tokenizer = BYTES if model.config.vocab_size == BYTE_VOCAB else None
    else:
        raise ValueError(
            f"{str(source)!r} does not exist: expected a run folder or a model file saved with "
            "OctLM.save"
        )
    kind = None if tokenizer is None else BYTES if tokenizer == BYTES else "bpe"
    if format == "gguf":
        from octlm.integrations import gguf_format

        dtype = dtype or "float32"
        path = export_gguf(model, out, tokenizer=tokenizer, dtype=dtype)
        fallbacks = gguf_format.fallbacks(model.config, model.state_dict(), dtype)
        architecture = f"GGUF {gguf_format.architecture(model.config)}"
        return Exported(path, architecture, step, kind, how, tuple(fallbacks))
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


def export_model(
    model: OctLM, out: str | os.PathLike, *, tokenizer: str | os.PathLike | None = BYTES
) -> Path:
    """Write ``model`` to the new folder ``out`` as transformers' Llama (Mistral with a window,
    Qwen3 with QK-norm), weights in their dtype, with ``tokenizer``: ``"bytes"``, the path of a
    BPE ``tokenizer.json``, or None for no tokenizer files. Returns ``out``."""
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
            llama_format.write(staging, model.config, model.state_dict(), end)
            if tokenizer is not None:
                path = None if bpe is None else tokenizer
                tokenizer_files.write(staging, path, model.config.max_length, end)
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
    with ``tokenizer``: ``"bytes"`` or the path of a BPE ``tokenizer.json``. Returns ``out``."""
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
    out.parent.mkdir(parents=True, exist_ok=True)
    with signals.stop_on_signals():  # a stop removes what was staged
        descriptor, name = tempfile.mkstemp(dir=out.parent, prefix=f".{out.name}.export-")
        os.close(descriptor)
        staging = Path(name)
        try:
            _permissions_of_a_new_file(staging)
            bpe = None if tokenizer == BYTES else tokenizer
            try:
                gguf_format.write(staging, model.config, model.state_dict(), bpe, dtype)
            except OSError as error:  # numpy's tofile says only "N requested and 0 written"
                if error.errno is None and os.statvfs(out.parent).f_bavail == 0:
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(out)) from None
                raise
            _sync(staging)
            os.replace(staging, out)
            _sync(out.parent)
        except BaseException:
            staging.unlink(missing_ok=True)
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
