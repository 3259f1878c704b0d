"""What to measure: one :class:`Measurement` per worker, grids of them, and named suites.

A suite is a list of :class:`Grid` s, because the structure cases (window, prefill, decode,
padding) are several small grids, not one product. Command-line options override a field in
every grid of the chosen suite.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import asdict, dataclass, fields, replace
from types import ModuleType

from octlm.attention.tiled.options import DEFAULT_BLOCK

BACKENDS = ("naive", "math", "flash", "efficient", "cudnn", "tiled", "sketch", "triton", "auto")
# The structure and score keywords a measurement may add (docs/design.md, 'Tensor conventions'),
# each in one fixed form: 8 packed documents of equal length; left padding of the ``padding``
# fraction of keys (``key_starts``, where ``padding`` alone is right padding by ``key_lengths``); a
# softcap of 50 (Gemma 2's); ALiBi's usual slopes; one learnable sink per head.
FEATURES = ("documents", "left padding", "softcap", "alibi", "sinks")
MODES = ("forward", "train")
DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclass(frozen=True)
class Measurement:
    """Everything a worker needs for one measurement; also the record's identifying fields.

    ``length`` is the number of keys; ``q_len`` queries attend to them, bottom-right causal
    (``q_len < length`` is a chunk of new tokens after a cache). ``padding`` is the fraction of
    keys hidden by ``key_lengths``. ``block`` is the tiled backend's ``(block_q, block_k)`` and
    ``None`` for the others. ``busy``: measured while the driver ran one CPU-bound competing
    process beside it (``octlm bench --busy``). ``feature``: one of :data:`FEATURES`, or None.
    """

    backend: str
    mode: str
    dtype: str
    batch: int
    heads: int
    kv_heads: int
    head_size: int
    length: int
    q_len: int
    causal: bool
    window: int
    padding: float
    block: tuple[int, int] | None
    repeats: int
    warmup: int
    device: str
    busy: bool = False
    feature: str | None = None

    def key(self) -> tuple:
        """What makes two measurements the same one (repeats and warm-up do not)."""
        return key_of(asdict(self))

    def label(self) -> str:
        """Short, for the progress bar."""
        shape = f"{self.length}" if self.q_len == self.length else f"{self.q_len}x{self.length}"
        extra = "".join(
            f" {name}={value}"
            for name, value in (
                ("window", self.window),
                ("padding", self.padding),
                ("feature", self.feature),
            )
            if value
        )
        return f"{self.backend} {self.mode} {self.dtype} {shape}{extra}" + " busy" * self.busy


# What makes two measurements the same one: every field but the repeats, the warm-up and the
# device (which records keep beside the key).
KEY_FIELDS = tuple(
    f.name for f in fields(Measurement) if f.name not in ("repeats", "warmup", "device")
)


def key_of(record: dict) -> tuple:
    """:meth:`Measurement.key` of a record, so a file can say which measurements it holds;
    its fields are named by :data:`KEY_FIELDS`."""
    known = [f for f in fields(Measurement) if f.name in KEY_FIELDS]
    names = [f.name for f in known]
    # A field added later (``busy``, ``feature``) reads as its default in records written
    # before it.
    values = [record.get(f.name, f.default) for f in known]
    block = record.get("block")
    values[names.index("block")] = tuple(block) if block else None
    return tuple(values)


@dataclass(frozen=True)
class Grid:
    """A product of options; ``q_lens`` entry ``None`` means as many queries as keys."""

    backends: tuple[str, ...]
    lengths: tuple[int, ...]
    dtypes: tuple[str, ...] = ("float32",)
    modes: tuple[str, ...] = ("forward",)
    head_sizes: tuple[int, ...] = (32,)
    q_lens: tuple[int | None, ...] = (None,)
    windows: tuple[int, ...] = (0,)
    paddings: tuple[float, ...] = (0.0,)
    busy: tuple[bool, ...] = (False,)  # (False, True): each point idle, then beside a competitor
    features: tuple[str | None, ...] = (None,)
    batch: int = 1
    heads: int = 8
    kv_heads: int | None = None  # None: as many as heads
    causal: bool = True
    block: tuple[int, int] = DEFAULT_BLOCK
    repeats: int = 5
    device: str = "cpu"

    def measurements(self) -> list[Measurement]:
        """Shortest lengths first, so an interrupted run has the cheap rows.

        Two warm-up calls on CPU: the allocator settles only after the first large frees.
        """
        warmup = 3 if self.device.startswith("cuda") else 2
        combos = itertools.product(
            self.lengths,
            self.head_sizes,
            self.dtypes,
            self.modes,
            self.q_lens,
            self.windows,
            self.paddings,
            self.busy,
            self.features,
            self.backends,
        )
        out = []
        for (
            length,
            head_size,
            dtype,
            mode,
            q_len,
            window,
            padding,
            busy,
            feature,
            backend,
        ) in combos:
            if q_len is not None and q_len > length:
                continue  # more new queries than keys: not a cache shape
            out.append(
                Measurement(
                    backend=backend,
                    mode=mode,
                    dtype=dtype,
                    batch=self.batch,
                    heads=self.heads,
                    kv_heads=self.heads if self.kv_heads is None else self.kv_heads,
                    head_size=head_size,
                    length=length,
                    q_len=length if q_len is None else q_len,
                    causal=self.causal,
                    window=window,
                    padding=padding,
                    block=self.block if backend == "tiled" else None,
                    repeats=self.repeats,
                    warmup=warmup,
                    device=self.device,
                    busy=busy,
                    feature=feature,
                )
            )
        return out


# The options of a grid that the command line may override.
GRID_OPTIONS = tuple(f.name for f in fields(Grid))

_CPU_LENGTHS = (1024, 2048, 4096, 8192)
_CUDA_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
_STRUCTURE = Grid(backends=("flash", "tiled", "math"), lengths=(8192,))
_ROUTE = Grid(backends=("auto", "flash", "tiled"), lengths=(8192,))

SUITES: dict[str, tuple[Grid, ...]] = {
    # The baseline, in minutes on 2 CPU cores (``make report``): SDPA's MATH against its FLASH
    # backend and tiled, forward, batch 1, 8 heads of 32, causal, float32 to 8,192 tokens;
    # bfloat16 against float32 (MATH to 4,096); naive and the blocking sketch that tiled grew
    # from (bench/sketch.py) to 4,096; the memory-efficient backend once, to say if the CPU
    # has a kernel for it.
    "baseline": (
        Grid(backends=("math", "flash", "tiled"), lengths=_CPU_LENGTHS),
        Grid(backends=("flash", "tiled"), lengths=_CPU_LENGTHS, dtypes=("bfloat16",)),
        Grid(backends=("math",), lengths=_CPU_LENGTHS[:-1], dtypes=("bfloat16",)),
        Grid(backends=("naive", "sketch"), lengths=_CPU_LENGTHS[:-1]),
        Grid(backends=("efficient",), lengths=_CPU_LENGTHS[:1]),
    ),
    # The whole baseline grid (``make reference``): every backend at every length in float32
    # and bfloat16, and the sketch to 8,192; naive alone at 8,192 takes minutes and GiBs.
    "reference": (
        Grid(
            backends=("math", "flash", "efficient", "tiled", "naive"),
            lengths=_CPU_LENGTHS,
            dtypes=("float32", "bfloat16"),
        ),
        Grid(backends=("sketch",), lengths=_CPU_LENGTHS),
    ),
    # Forward + backward, to 16,384, where MATH's score matrices no longer fit (the memory
    # guard records it as skipped, with its estimate).
    "train": (
        Grid(backends=("math", "flash", "tiled"), lengths=(*_CPU_LENGTHS, 16384), modes=("train",)),
    ),
    # Structure that tiled can skip and a dense mask cannot.
    "structure": (
        replace(_STRUCTURE, windows=(512,), modes=("forward", "train")),
        replace(_STRUCTURE, q_lens=(1024,)),
        replace(_STRUCTURE, q_lens=(1,)),
        replace(_STRUCTURE, paddings=(0.5,)),
        # Packed documents, left padding, score modifiers and sinks: tiled computes them per
        # tile; SDPA is given their dense mask (and, for modifiers, a dense float bias).
        replace(_STRUCTURE, features=("documents",), modes=("forward", "train")),
        replace(_STRUCTURE, features=("left padding",), paddings=(0.5,)),
        replace(_STRUCTURE, features=("softcap", "alibi", "sinks"), modes=("forward", "train")),
    ),
    # attention="auto" beside the two paths it chooses between (SDPA's FLASH, tiled), on each
    # case of its rule (octlm.attention.route): plain causal, a window, packed documents, right
    # padding, the score modifiers and sinks, one decoding row and a chunk after a cache.
    "route": (
        replace(_ROUTE, modes=("forward", "train")),
        replace(_ROUTE, windows=(512,)),
        replace(_ROUTE, features=("documents",), modes=("forward", "train")),
        replace(_ROUTE, paddings=(0.5,)),
        replace(_ROUTE, features=("softcap", "alibi", "sinks")),
        replace(_ROUTE, q_lens=(1, 1024)),
    ),
    "cuda": (
        Grid(
            backends=("math", "flash", "efficient", "cudnn", "tiled", "triton"),
            lengths=_CUDA_LENGTHS,
            dtypes=("float16", "bfloat16"),
            modes=("forward", "train"),
            head_sizes=(64, 128),
            repeats=10,
            device="cuda",
        ),
    ),
}


# Other names of suites, as committed records name their experiment (``bench-seed``).
ALIASES = {"seed": "baseline"}
# What each grid suite measures, in one line (``octlm bench --help``).
SUMMARIES = {
    "baseline": "the baseline's shape in minutes: MATH, FLASH, tiled, naive, the sketch",
    "reference": "the baseline's whole grid: every backend, length and dtype (long)",
    "train": "MATH, FLASH and tiled, forward + backward, to 16,384 tokens",
    "structure": "window, prefill, decode, padding, documents, score features vs a dense mask",
    "route": 'attention="auto" beside FLASH and tiled on each case of its rule',
    "cuda": "the CUDA grid (scripts/gpu_check.sh)",
}
# Suites that are programs of their own, not grids of worker measurements: each module's
# ``add_arguments(parser)`` and ``execute(args, parser)`` are ``octlm bench NAME`` (its own
# options: ``octlm bench NAME --help``), and it times its calls with the same loop
# (:mod:`octlm.lab.bench.timing`).
PROGRAMS = {
    "decode": "octlm.lab.bench.decode",  # generation speed through the KV cache, tiled vs sdpa
    "documents": "octlm.lab.bench.documents",  # packed documents: tiled, SDPA, FlexAttention
    "ring": "octlm.lab.bench.ring",  # ring attention over W processes against tiled in one
    "training": "octlm.lab.bench.training",  # octlm train's overhead, and each attention in it
}


def suite_name(name: str) -> str:
    """The suite ``name`` stands for (an alias resolved); ``ValueError`` if none."""
    name = ALIASES.get(name, name)
    if name in PROGRAMS:
        raise ValueError(f"suite {name!r} is a program: run it as octlm bench {name}")
    if name not in SUITES:
        raise ValueError(f"suite must be one of {sorted([*SUITES, *ALIASES])}, got {name!r}")
    return name


def suite(name: str, **overrides) -> list[Measurement]:
    """The measurements of suite ``name``, each grid with ``overrides`` (``None`` = keep).

    A combination with more queries than keys is left out (not a cache shape); options that
    leave nothing to measure are refused.
    """
    overrides = {key: value for key, value in overrides.items() if value is not None}
    grids = [replace(grid, **overrides) for grid in SUITES[suite_name(name)]]
    for grid in grids:
        _check(grid)
    # Overrides can make two grids alike (--window on the structure suite): measure once.
    found = list(dict.fromkeys(m for grid in grids for m in grid.measurements()))
    if not found:
        q_lens = sorted({q for grid in grids for q in grid.q_lens if q is not None})
        lengths = sorted({n for grid in grids for n in grid.lengths})
        raise ValueError(
            f"nothing to measure: every --q-len {q_lens} exceeds every --lengths {lengths} "
            "(queries attend to at most LENGTH keys)"
        )
    return found


def _check(grid: Grid) -> None:
    """Reject a grid that no worker could run; the message names the command-line option."""
    for name, option, allowed in (
        ("backends", "--backends", BACKENDS),
        ("modes", "--modes", MODES),
        ("dtypes", "--dtypes", DTYPES),
    ):
        wrong = [value for value in getattr(grid, name) if value not in allowed]
        if wrong:
            raise ValueError(f"{name} ({option}) must be among {list(allowed)}, got {wrong}")
    for name, option, values, low in (
        ("lengths", "--lengths", grid.lengths, 1),
        ("head_sizes", "--head-size", grid.head_sizes, 1),
        ("q_lens", "--q-len", [q for q in grid.q_lens if q is not None], 1),
        ("windows", "--window", grid.windows, 0),
    ):
        if any(value < low for value in values):
            raise ValueError(f"{name} ({option}) must be >= {low}, got {list(values)}")
    wrong = [feature for feature in grid.features if feature not in (*FEATURES, None)]
    if wrong:
        raise ValueError(f"features (--features) must be among {list(FEATURES)}, got {wrong}")
    if any(not 0.0 <= padding < 1.0 for padding in grid.paddings):
        raise ValueError(f"paddings (--padding) must lie in [0, 1), got {list(grid.paddings)}")
    kv_heads = grid.heads if grid.kv_heads is None else grid.kv_heads
    if grid.batch < 1 or grid.heads < 1 or kv_heads < 1 or grid.heads % kv_heads:
        raise ValueError(
            f"--batch ({grid.batch}) and --heads ({grid.heads}) must be >= 1, and heads a "
            f"multiple of --kv-heads ({kv_heads})"
        )
    if grid.repeats < 1:
        raise ValueError(f"repeats (--repeats) must be >= 1, got {grid.repeats}")
    if grid.device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"device (--device) must be cpu or cuda, got {grid.device!r}")


def run_program(module: ModuleType, argv: list[str] | None = None) -> int:
    """A program suite's module run on its own (``python -m``): the program ``octlm bench``
    runs for that suite, its options from the module's ``add_arguments``."""
    name = module.__spec__.name if module.__spec__ else module.__name__  # __main__ under -m
    parser = argparse.ArgumentParser(
        prog=f"python -m {name}", description=module.__doc__.splitlines()[0]
    )
    module.add_arguments(parser)
    return module.execute(parser.parse_args(argv), parser)
