"""Held-out bits per byte of GGUF files in llama.cpp, beside octlm's own figure for the same
checkpoint: how far an exported or quantized file lies from the model.

    .venv/bin/python benchmarks/gguf_bits.py RUN_DIR FILE.gguf [FILE.gguf ...]
        [--step best|last|N] [--quantize Q4_K_M ...] [--output FILE]

Both figures read the run's validation split by benchmarks/held_out_bits.py's protocol (windows
of the run's ``--length`` overlapping by one token, every target scored once, from at most
``length`` tokens of context); llama.cpp (llama-cpp-python: ``make llama-cpp``) scores each
window from its own logits, with a float32 KV cache and flash attention off. ``--quantize TYPE``
first writes the first file's TYPE twin (it should be the float32 export: llama.cpp does not
quantize a quantized file again) with llama.cpp's own quantizer (``llama_model_quantize``, what
``llama-quantize`` runs) and scores it too. The files should be exports of the checkpoint
``--step`` names. One record per file: its matrices' types, its bits per byte, octlm's, and
their ratio; printed, and appended to ``--output`` when given.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import math
import sys
from pathlib import Path

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from held_out_bits import held_out, validation, windows

from octlm import records
from octlm.tokenizer import load_tokenizer
from octlm.training.folder import BEST

LLAMA_CPP = "llama-cpp-python is needed: make llama-cpp"


def matrix_types(path: Path) -> dict[str, int]:
    """How many matrices of the file are of each GGML type (its 1-D norms left out)."""
    reader = gguf.GGUFReader(path)
    kinds = [tensor.tensor_type.name for tensor in reader.tensors if len(tensor.shape) > 1]
    return dict(sorted(collections.Counter(kinds).items()))


def quantize(source: Path, kind: str) -> Path:
    """``source`` quantized to ``kind`` (Q4_K_M, Q8_0, ...) by llama.cpp, beside it."""
    import llama_cpp

    name = f"LLAMA_FTYPE_MOSTLY_{kind.upper()}"
    if not hasattr(llama_cpp, name):
        raise ValueError(f"--quantize: llama.cpp has no type {kind!r} (no {name})")
    out = source.with_name(f"{source.stem}-{kind.lower()}.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, name)
    status = llama_cpp.llama_model_quantize(
        str(source).encode(), str(out).encode(), ctypes.byref(params)
    )
    if status != 0:
        raise RuntimeError(f"llama_model_quantize {source} -> {kind}: status {status}")
    return out


def llama_cpp_bits(path: Path, tokens: torch.Tensor, length: int, token_bytes) -> float:
    """Bits per byte of the GGUF file ``path`` in llama.cpp over ``tokens (N,)``."""
    import llama_cpp

    llm = llama_cpp.Llama(
        str(path), n_ctx=max(length, 256), logits_all=True, verbose=False,
        type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32, flash_attn=False,
    )  # fmt: skip
    nats, covered = 0.0, 0
    for window in windows(tokens, length):  # (T + 1,) each
        llm.reset()
        llm.eval(window[:-1].tolist())
        logits = torch.from_numpy(np.array(llm.scores[: len(window) - 1])).double()  # (T, V)
        targets = window[1:]  # (T,)
        nats += F.cross_entropy(logits, targets, reduction="sum").item()
        covered += int(token_bytes[targets].sum())
    return nats / math.log(2) / covered


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, metavar="RUN_DIR")
    parser.add_argument("files", nargs="+", type=Path, metavar="FILE.gguf")
    parser.add_argument(
        "--step",
        type=lambda text: int(text) if text.isdigit() else text,
        default=BEST,
        help="the checkpoint the files were exported from, for octlm's figure (default "
        "%(default)s)",
    )
    parser.add_argument("--quantize", nargs="+", default=[], metavar="TYPE")
    parser.add_argument("--output", type=Path, help="records file to append to")
    args = parser.parse_args(argv)
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        parser.error(LLAMA_CPP)
    ours = held_out(args.run, args.step)
    length, tokens = validation(args.run)
    token_bytes = load_tokenizer(args.run).token_bytes  # (V,)
    files = list(args.files)
    files += [quantize(args.files[0], kind) for kind in args.quantize]
    for path in files:
        bits = llama_cpp_bits(path, tokens, length, token_bytes)
        record = records.make("check", "gguf-bits") | {
            "folder": str(args.run), "file": str(path), "step": ours["step"],
            "checkpoint": ours["checkpoint"], "types": matrix_types(path),
            "bits_per_byte": bits, "octlm_bits_per_byte": ours["bits_per_byte"],
            "ratio": bits / ours["bits_per_byte"],
        }  # fmt: skip
        if args.output is not None:
            records.append(args.output, record)
        print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
