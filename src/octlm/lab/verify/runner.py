"""Run the experiments into records, one file per experiment, and summarise them."""

from __future__ import annotations

import datetime as _dt
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
from tqdm import tqdm

from octlm import records
from octlm.lab.verify.attention import block_invariance, gradients, partial_outputs, tiled_vs_sdpa
from octlm.lab.verify.model import decoding, model_equivalence, training
from octlm.lab.verify.plan import FULL, TESTED_DTYPES, Plan, default_dtypes
from octlm.lab.verify.structure import structure

EXPERIMENTS: dict[str, Callable[[Plan, str, Sequence[torch.dtype]], Iterator[dict]]] = {
    "tiled-sdpa": tiled_vs_sdpa,
    "model-equivalence": model_equivalence,
    "block-invariance": block_invariance,
    "partial-outputs": partial_outputs,
    "gradients": gradients,
    "structure": structure,
    "decoding": decoding,
    "training": training,
}


def check_options(device: str, dtypes: Sequence[str], experiments: Sequence[str]) -> None:
    """Raise ``ValueError`` naming the option that :func:`run` cannot use."""
    if not isinstance(device, str) or device.split(":")[0] not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda[:index], got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} asked for, but this PyTorch sees no CUDA device")
    for name in dtypes:
        if name not in TESTED_DTYPES:
            raise ValueError(f"dtype must be among {list(TESTED_DTYPES)}, got {name!r}")
    for name in experiments:
        if name not in EXPERIMENTS:
            raise ValueError(f"experiment must be among {list(EXPERIMENTS)}, got {name!r}")


def run(
    out: str | Path = records.LOCAL,
    *,
    plan: Plan = FULL,
    device: str = "cpu",
    dtypes: Sequence[str] | None = None,
    experiments: Sequence[str] | None = None,
    progress: bool = True,
) -> tuple[list[dict], list[Path]]:
    """Run the experiments, appending each record to ``out/<date>-<experiment>.jsonl`` (UTC
        date) as soon as it is computed; a progress bar per experiment goes to stderr.

        Every record of one call carries the same fresh ``run`` id, so a report over a folder
        that holds several runs counts only each experiment's latest. Returns every record and
        the files written. ``dtypes`` (names in :data:`TESTED_DTYPES`) default to
        :func:`default_dtypes`; ``experiments`` to all of :data:`EXPERIMENTS`, in order (a name
    given twice runs once). Every
        file is checked writable before the first check runs (``ValueError`` if not).
    """
    check_options(device, dtypes or (), experiments or ())
    dtypes = default_dtypes(device) if dtypes is None else tuple(dict.fromkeys(dtypes))
    experiments = list(EXPERIMENTS if experiments is None else dict.fromkeys(experiments))
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d")
    paths = [
        records.check_writable(Path(out) / f"{date}-{name}.jsonl", "output folder (--out)")
        for name in experiments
    ]
    run_id = records.new_run()
    found = []
    for experiment, path in zip(experiments, paths, strict=True):
        failed = 0
        # disable=None: a bar on a terminal, none in a log file.
        bar = tqdm(
            desc=experiment, unit=" checks", file=sys.stderr, disable=None if progress else True
        )
        with bar:
            for fields in EXPERIMENTS[experiment](plan, device, [TESTED_DTYPES[d] for d in dtypes]):
                record = records.make("verify", experiment, device, run=run_id, **fields)
                records.append(path, record)
                found.append(record)
                failed += not record["passed"]
                bar.update()
                bar.set_postfix_str(f"{failed} failed" if failed else "all passed")
    return found, paths


def summary(found: Sequence[dict]) -> str:
    """A compact table: per experiment, check, left side and dtype, the worst error (largest
    against its tolerance) beside the plain method's error and the tolerance they give, the
    largest pairwise difference, and the verdict. Checks that the equality rule does not
    judge (token counts, loss curves) show only their verdict."""
    groups: dict[tuple[str, str, str, str], list[dict]] = {}
    for record in found:
        key = (record["experiment"], record["check"], record["left"], record["dtype"])
        groups.setdefault(key, []).append(record)
    rows = [
        (
            "experiment",
            "check",
            "left",
            "dtype",
            "n",
            "worst error",
            "naive's error",
            "tolerance",
            "max diff",
            "result",
        ),
    ]
    for (experiment, check, left, dtype), group in groups.items():
        judged = [r for r in group if r["tolerance"] is not None]
        figures = ["-"] * 4
        if judged:
            worst = max(
                judged, key=lambda r: r["error"] / r["tolerance"] if r["tolerance"] else r["error"]
            )
            diff = max(r["max_abs_diff"] for r in judged)
            figures = [f"{worst[name]:.3g}" for name in ("error", "base_error", "tolerance")]
            figures.append(f"{diff:.3g}")
        failed = sum(not r["passed"] for r in group)
        rows.append(
            (
                experiment,
                check if len(check) <= 40 else check[:39] + "…",
                left,
                dtype,
                str(len(group)),
                *figures,
                f"FAIL ({failed})" if failed else "pass",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
