"""The Triton kernels compile for a GPU, on a machine without one.

The interpreter runs the kernels as Python, so it cannot see what only the compiler rejects
(a loop-carried value that changes type, an argument passed as None that the kernel still
reads). Triton ships its own ``ptxas``: this test compiles the three kernels for sm_90 with
every option on and off, in a fresh process (the interpreter must be off there), through to
a cubin. It needs no driver and runs nothing.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton.backends.nvidia", reason="needs Triton with its CUDA backend")

COMPILE = textwrap.dedent(
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from octlm.attention.tiled import triton_flash as kernels
    from octlm.attention.tiled import triton_kernels

    # fp32 whatever the inputs
    FLOATS = ("LSE", "DELTA", "SLOPES", "SINKS", "DSLOPES", "SHIFT", "TOTAL", "INVERSE")
    INTEGERS = {"DOCS": "*i32", "BOUNDS": "*i32"}
    OPTIONS = ("DOCUMENTS", "PADDED", "SOFTCAP", "ALIBI", "SINK", "SLOPE_GRAD")
    USES = {"DOCUMENTS": "DOCS", "PADDED": "BOUNDS", "ALIBI": "SLOPES", "SINK": "SINKS",
            "SLOPE_GRAD": "DSLOPES"}

    def compile_kernel(kernel, dtype, on, tiles):
        constants = dict(HEAD_SIZE=40, HEAD_BLOCK=64, BLOCK_M=tiles[0], BLOCK_N=tiles[1],
                         CAUSAL=True, PRECISION="ieee" if dtype == "fp32" else None)
        constants |= {name: on for name in OPTIONS if name in kernel.arg_names}
        signature = {}
        for name in kernel.arg_names:
            if name in constants or (not on and name in USES.values()):
                signature[name] = "constexpr"  # an option's pointer is None when it is off
                constants.setdefault(name, None)
            elif name.isupper():
                signature[name] = INTEGERS.get(name, "*fp32" if name in FLOATS else "*" + dtype)
            else:
                signature[name] = "fp32" if name in ("scale", "softcap") else "i32"
        source = triton.compiler.ASTSource(kernel, signature, constants)
        options = dict(num_warps=tiles[2], num_stages=tiles[3])
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
        assert compiled.asm["cubin"], kernel.__name__

    for dtype, table in (("fp16", kernels._HALF_TILES), ("fp32", kernels._FLOAT32_TILES)):
        for on in (False, True):
            compile_kernel(triton_kernels._forward_kernel, dtype, on, table["forward"][64])
            compile_kernel(triton_kernels._key_value_grad_kernel, dtype, on, table["key_value"][64])
            compile_kernel(triton_kernels._query_grad_kernel, dtype, on, table["query"][64])
    print("compiled")
    """
)


def test_kernels_compile_for_sm90_with_every_option():
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE], env=env, capture_output=True, text=True, timeout=300
    )  # fmt: skip
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
