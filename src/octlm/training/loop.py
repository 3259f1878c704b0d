"""The training loop, top to bottom: folder, data, model, then steps with evals and checkpoints.

One optimizer step draws the global batch ``(B, T)`` (the same on every rank): random windows,
or with ``pack`` rows of whole documents kept apart by ``document_ids``. It keeps this rank's
rows (or, under context parallelism, all rows and this rank's positions), cuts them into
``accumulate`` micro-batches, and adds their gradients; then clipping, the optimizer, the
schedule (over the steps, or over the training time of a ``time_budget``, which also ends the
run).
The loss is the mean over the targets the global batch counts (packing ignores some), so
accumulation and ranks leave it unchanged. Losses per byte (bits) divide the summed token
losses by the bytes those tokens stand for, so runs with other tokenizers compare.
Every source of randomness is seeded and checkpointed (weights, batch positions, dropout), so
on CPU in float32 a run resumed from step ``k`` repeats the uninterrupted run's losses exactly.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.checkpoint import checkpoint as recompute
from tqdm.auto import tqdm

from octlm.attention import implementation
from octlm.context_parallel import context_parallel_loss
from octlm.model import ModelConfig, OctLM
from octlm.tokenizer import STORING as STORING_TOKENIZER
from octlm.tokenizer import TOKENIZER_FILE, BPETokenizer, ByteTokenizer, load_tokenizer
from octlm.training import checkpoint, data, distributed, lock
from octlm.training.budget import Stopwatch
from octlm.training.config import (
    CONFIG_FILE,
    DTYPES,
    RunConfig,
    check_resumable,
    imported_tokenizer,
    parameter_count,
    read_file,
    to_dict,
)
from octlm.training.distributed import Cluster
from octlm.training.metrics import METRICS, PICTURE, Metrics, peak_memory, plot
from octlm.training.optim import make_optimizer, make_scheduler
from octlm.training.sample import generate_text, single_process

DATA_FOLDER = "data"
# Marks a run folder that octlm made and has not yet brought to its first step.
PREPARING = ".octlm-preparing"
# config.json while it is written (then renamed into place).
STORING = f".{CONFIG_FILE}.tmp"
LN2 = math.log(2)


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP before the first step: nothing was trained. A new run's folder
    keeps what its preparation wrote until the next start clears it; a resumed run is as it
    was."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} before the first step")
        self.signum = signum


@dataclass(frozen=True)
class Outcome:
    """Where a run ended: the step reached, its last evaluation, why it stopped."""

    folder: Path
    step: int
    val_loss: float | None
    val_bits_per_byte: float | None
    stopped_by: str | None  # the signal that ended the run early, None if it ran to the end
    rank: int  # this process's rank: 0 speaks for the run


def train(
    model_config: ModelConfig,
    run: RunConfig,
    out: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    clock: Callable[[], float] = time.monotonic,
) -> Outcome:
    """Train ``OctLM(model_config)`` as ``run`` says, keeping everything in the folder ``out``.

    A new run refuses a non-empty ``out`` unless ``overwrite``; ``resume`` continues from the
    latest checkpoint there. One run at a time holds ``out`` (:mod:`octlm.training.lock`); a
    second start or resume is refused before it reads or writes anything there. Under torchrun
    every process calls this; rank 0 holds the folder and writes the files.
    SIGINT, SIGTERM and SIGHUP end the run after the current step, with a checkpoint; before
    the first step they raise :class:`Interrupted`, and the next start clears what was prepared.
    ``clock`` (seconds) measures the training time that ``run.time_budget`` spends.
    """
    if run.init_from is not None and not resume:  # the run keeps its weights' tokenizer
        run = imported_tokenizer(run, model_config.vocab_size)
    cluster = distributed.setup(run.device, fsdp=run.fsdp, context_parallel=run.context_parallel)
    folder = Path(out)
    try:
        with _stop_on_signals() as stop, _holding(folder, cluster):
            return _train(
                model_config, run, folder, cluster, resume, overwrite, progress, stop, clock
            )
    finally:
        distributed.teardown(cluster)


@contextlib.contextmanager
def _holding(folder: Path, cluster: Cluster):
    """The run folder's lock, held by rank 0 for the run's life. Every rank waits until rank 0
    holds it, and all raise its ValueError when it is refused."""
    held = []
    _on_main(cluster, lambda: held.append(lock.acquire(folder)))
    try:
        yield
    finally:
        ours = (folder / PREPARING).exists() or (folder / CONFIG_FILE).exists()
        for folder_lock in held:  # rank 0's
            folder_lock.release(keep=ours)


def _train(model_config, run, folder, cluster, resume, overwrite, progress, stop, clock) -> Outcome:
    _check_run(model_config, run, cluster)
    summary = _on_main(cluster, lambda: _prepare(folder, model_config, run, resume, overwrite))
    tokens = {
        split: data.load_tokens(folder / DATA_FOLDER, split, run.length) for split in data.SPLITS
    }
    tokenizer = load_tokenizer(folder)  # checked against the run by _prepare
    token_bytes = tokenizer.token_bytes  # (V,) bytes each token stands for
    torch.manual_seed(run.seed)  # the same initial weights on every rank
    raw = OctLM(model_config).to(cluster.device)
    if run.init_from is not None and not resume:  # fine-tuning: the folder's weights
        raw.load_state_dict(OctLM.from_pretrained(run.init_from).state_dict())
    if run.checkpoint_activations:
        _recompute_blocks(raw)
    distributed.shard(raw, cluster)
    optimizer = make_optimizer(
        raw, run.lr, run.weight_decay, optimizer=run.optimizer, muon_lr=run.muon_lr
    )
    stopwatch = Stopwatch(clock)  # training time, over every launch of the run
    scheduler = make_scheduler(
        optimizer, warmup=run.warmup, steps=run.steps, min_ratio=run.min_lr_ratio,
        budget=run.budget_seconds, elapsed=lambda: stopwatch.elapsed,
    )  # fmt: skip
    scaler = torch.amp.GradScaler(cluster.device.type, enabled=run.dtype == "float16")
    batches = (
        data.PackedBatches(
            tokens["train"], run.length, run.seed, data.load_starts(folder / DATA_FOLDER, "train")
        )
        if run.pack
        else data.Batches(tokens["train"], run.length, run.seed)
    )
    validation = data.evaluation_batches(tokens["val"], run.length, run.batch, run.eval_batches)
    val_tokens_per_byte = _tokens_per_byte(validation, token_bytes)
    torch.manual_seed(run.seed + cluster.rank)  # dropout differs between ranks' rows
    metrics = Metrics(folder, cluster.device, enabled=cluster.is_main)
    start = 0
    if resume:
        start = _restore(
            folder, model_config, raw, optimizer, scheduler, scaler, batches, cluster, stopwatch
        )
        if run.steps is not None and start >= run.steps:
            raise ValueError(
                f"--resume: the run in {str(folder)!r} is at step {start} already and --steps is "
                f"{run.steps}: pass a larger --steps to train it further"
            )
        if run.time_budget is not None and stopwatch.elapsed >= run.budget_seconds:
            raise ValueError(
                f"--resume: the run in {str(folder)!r} has trained for {stopwatch.elapsed:.0f} s "
                f"already and --time-budget is {run.time_budget}: pass a larger --time-budget "
                "to train it further"
            )
        metrics.forget_after(start)
    model = distributed.wrap(raw, cluster)
    if run.compile:
        model = torch.compile(model)
    autocast = torch.autocast(
        cluster.device.type, dtype=DTYPES[run.dtype], enabled=run.dtype != "float32"
    )
    stop["armed"] = True  # from here a signal ends the run after a step, with a checkpoint
    if cluster.is_main:
        if not resume:  # everything before the first step worked: the folder is now a run
            _store_config(folder, model_config, run)
            (folder / PREPARING).unlink()
        _announce(summary, model_config, run, cluster, start)

    bar = tqdm(
        total=run.steps, initial=start, unit="step", disable=not (progress and cluster.is_main)
    )
    began, tokens_seen = time.perf_counter(), 0
    last_eval, stopped_by = None, None
    step = start
    stopwatch.start()
    for step in range(start + 1, (run.steps or sys.maxsize) + 1):
        batch = batches.next(run.batch)  # (B, T) each, the same on every rank
        loss, grad_norm, lr = _step(model, raw, batch, optimizer, scaler, autocast, run, cluster)
        # Under a budget the schedule and the end follow rank 0's clock on every rank.
        stopwatch.lap(cluster.share if run.time_budget else None)
        scheduler.step()
        if resume and step == start + 1 and cluster.is_main:
            # Its first step worked: the run keeps what the flags changed (more steps, another
            # device or attention) for the next --resume. A resume that fails before here
            # leaves config.json as it was.
            _store_config(folder, model_config, run)
        bar.update()
        tokens_seen += run.batch * run.length
        signalled = cluster.any(stop["signal"] is not None)
        spent = run.time_budget is not None and stopwatch.elapsed >= run.budget_seconds
        final = step == run.steps or signalled or spent
        train_loss = None
        if step % run.log_every == 0 or final:
            train_loss = cluster.total(loss).item()
            seconds = time.perf_counter() - began
            bits_per_byte = train_loss * _tokens_per_byte([batch], token_bytes) / LN2
            metrics.write(
                "train_step", step=step, loss=train_loss, bits_per_byte=bits_per_byte, lr=lr,
                grad_norm=grad_norm.item(), tokens_per_second=tokens_seen / seconds,
                train_seconds=stopwatch.elapsed,
                **peak_memory(cluster.device),
            )  # fmt: skip
            bar.set_postfix(loss=f"{train_loss:.3f}", tok_s=f"{tokens_seen / seconds:,.0f}")
            began, tokens_seen = time.perf_counter(), 0
        # Before the evaluation: an evaluation that fails (memory, a full disk) loses no step.
        if step % run.checkpoint_every == 0 or final:
            _save(
                folder, step, raw, optimizer, scheduler, scaler, batches, model_config, run,
                cluster, stopwatch.elapsed,
            )  # fmt: skip
        if step % run.eval_every == 0 or step == run.steps or spent:
            train_loss = cluster.total(loss).item() if train_loss is None else train_loss
            with stopwatch.paused():
                last_eval = _evaluate(
                    model, raw, validation, val_tokens_per_byte, tokenizer, autocast, run,
                    model_config, cluster,
                )  # fmt: skip
            metrics.write(
                "eval", step=step, loss=train_loss, val_loss=last_eval[0],
                val_bits_per_byte=last_eval[1], sample=last_eval[2],
                train_seconds=stopwatch.elapsed,
            )  # fmt: skip
            if cluster.is_main:
                bar.write(
                    f"step {step}: val loss {last_eval[0]:.4f}, {last_eval[1]:.3f} bits per byte"
                    f"\n  sample: {last_eval[2]!r}"
                )
                plot(folder)
            began, tokens_seen = time.perf_counter(), 0  # evaluation is not training time
        if signalled or spent:
            if not spent and step != run.steps:  # a signal in the last step ends nothing early
                stopped_by = stop["signal"] or "a signal on another rank"
            break
    bar.close()
    if cluster.is_main and stopped_by:
        print(f"stopped by {stopped_by} after step {step}; continue with --resume")
    val_loss, val_bits_per_byte, _sample = last_eval or (None, None, None)
    return Outcome(folder, step, val_loss, val_bits_per_byte, stopped_by, cluster.rank)


def _store_config(folder: Path, model_config: ModelConfig, run: RunConfig) -> None:
    """Write ``config.json`` atomically and durably: a temporary file, fsynced, renamed."""
    stored = folder / STORING
    with stored.open("w") as out:
        out.write(json.dumps(to_dict(model_config, run), indent=2) + "\n")
        out.flush()
        os.fsync(out.fileno())
    os.replace(stored, folder / CONFIG_FILE)


def _check_run(model_config: ModelConfig, run: RunConfig, cluster: Cluster) -> None:
    """Raise ValueError (on every rank alike) for a run these processes cannot do."""
    if (
        "kernel" in implementation(model_config.attention).tuning
        and model_config.kernel == "triton"
        and cluster.device.type != "cuda"
    ):
        raise ValueError(
            f"kernel 'triton' runs on CUDA only, and this run is on {cluster.device.type}; "
            "use kernel 'auto' or 'pytorch'"
        )
    if run.dtype == "float16" and cluster.device.type != "cuda":
        raise ValueError(
            "dtype float16 needs CUDA (its gradient scaler is CUDA's); use bfloat16 on CPU"
        )
    parts = cluster.data_ranks * run.accumulate
    if run.batch % parts:
        raise ValueError(
            f"batch ({run.batch}) must be a multiple of data-parallel ranks x accumulate "
            f"({cluster.data_ranks} x {run.accumulate} = {parts})"
        )
    if cluster.mode == "context" and run.length % (2 * cluster.world):
        raise ValueError(
            f"context parallelism cuts each sequence into 2 x {cluster.world} ranks chunks: "
            f"length ({run.length}) must be a multiple of {2 * cluster.world}"
        )


def _on_main(cluster: Cluster, work):
    """Run ``work`` on rank 0 and return its result on every rank; its ValueError or OSError
    (a full disk) too, so no rank waits for one that has failed."""
    result = None
    if cluster.is_main:
        try:
            result = ("ok", work())
        except ValueError as error:
            result = ("error", str(error))
        except OSError as error:
            result = ("os", (error.errno, error.strerror, error.filename))
    result = cluster.share(result)
    if result[0] == "error":
        raise ValueError(result[1])
    if result[0] == "os":
        raise OSError(*result[1])
    return result[1]


def _prepare(folder: Path, model_config, run, resume: bool, overwrite: bool) -> dict:
    """Check or create the run folder and write the token files; their summary.

    ``config.json``, which makes the folder a run, is written only once everything before the
    first step has worked (in :func:`_train`). Until then the folder carries ``PREPARING``: a
    start that did not get that far is cleared by the next one (:func:`_unfinished`).
    """
    config_path = folder / CONFIG_FILE
    bpe = None
    if run.init_from is not None and not resume:  # refused before the folder is touched
        from octlm.integrations.tokenizer_files import bpe_file

        bpe = bpe_file(run.init_from, model_config.vocab_size)
    if not resume and _unfinished(folder):  # a start of ours that failed: what it left goes
        shutil.rmtree(folder / DATA_FOLDER, ignore_errors=True)
        for name in (CONFIG_FILE, STORING, TOKENIZER_FILE, STORING_TOKENIZER, PREPARING):
            (folder / name).unlink(missing_ok=True)
    if resume:
        if not config_path.is_file():
            raise ValueError(f"--resume: {str(folder)!r} holds no run (no {CONFIG_FILE})")
        check_resumable(read_file(config_path), model_config, run)
        if checkpoint.latest(folder) is None:
            raise ValueError(
                f"--resume: {str(folder)!r} has no checkpoint to resume from (the run stopped "
                "before its first one): start it again with --overwrite"
            )
    elif any(entry.name != lock.LOCK_FILE for entry in folder.iterdir()):
        if not overwrite:
            raise ValueError(
                f"run folder {str(folder)!r} is not empty: pass --resume to continue its run "
                "or --overwrite to start it again"
            )
        _check_overwritable(folder)
        for entry in folder.iterdir():  # all but the lock, which this run holds
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            elif entry.name != lock.LOCK_FILE:
                entry.unlink()
    if not resume:  # this folder is empty and ours: marked, so a failed start can be cleared
        (folder / PREPARING).touch()
    if bpe is not None:  # the run keeps the tokenizer its weights were trained with
        shutil.copyfile(bpe, folder / TOKENIZER_FILE)
    summary = data.read_summary(folder / DATA_FOLDER)
    if summary is None and resume:
        raise ValueError(
            f"--resume: {str(folder / DATA_FOLDER / data.SUMMARY)!r} is missing, so the run's "
            "token files cannot be checked; start the run again (--overwrite)"
        )
    if summary is None:
        source, glob = data.default_corpus()
        source, glob = (
            (source, glob) if run.data is None else (run.data, run.glob or data.DEFAULT_GLOB)
        )
        glob = run.glob or glob
        if bpe is not None:  # the imported tokenizer, not one trained on this corpus
            tokenizer = BPETokenizer.from_file(folder / TOKENIZER_FILE)
        elif run.tokenizer == "bpe":
            texts = data.training_texts(source, glob, run.val_share)
            tokenizer = BPETokenizer.train(texts, model_config.vocab_size)
        else:
            tokenizer = ByteTokenizer()
        summary = data.write_tokens(source, glob, run.val_share, folder / DATA_FOLDER, tokenizer)
        if bpe is None:  # an imported tokenizer.json is already there, as it came
            tokenizer.save(folder)
    _check_tokenizer(folder, summary, model_config, run)
    return summary


def _check_tokenizer(folder: Path, summary: dict, model_config: ModelConfig, run) -> None:
    """Raise ValueError unless the token files (``data.json``) and the run folder's tokenizer
    are those the run's configuration names: its tokenizer and vocabulary."""
    tokenizer = load_tokenizer(folder)
    expected = (run.tokenizer, model_config.vocab_size)
    found = {
        f"{DATA_FOLDER}/{data.SUMMARY}": (summary["tokenizer"], summary["vocab_size"]),
        "the run folder's tokenizer": (tokenizer.name, tokenizer.vocab_size),
    }
    wrong = [
        f"{where} has {name} of {size} tokens"
        for where, (name, size) in found.items()
        if (name, size) != expected
    ]
    if wrong:
        raise ValueError(
            f"run folder {str(folder)!r} is for tokenizer {expected[0]} of vocab_size "
            f"{expected[1]}, but " + " and ".join(wrong) + "; start the run again (--overwrite)"
        )


def _unfinished(folder: Path) -> bool:
    """Whether ``folder`` is a start of octlm's that never reached its first step: marked when
    it was made (empty) and holding nothing but what that start writes."""
    if not (folder / PREPARING).is_file():
        return False
    own = {PREPARING, CONFIG_FILE, STORING, TOKENIZER_FILE, STORING_TOKENIZER, DATA_FOLDER}
    own.add(lock.LOCK_FILE)
    return not _foreign_entries(folder, own)


def _foreign_entries(folder: Path, own: set[str], checkpoints: bool = False) -> list[str]:
    """What in ``folder`` octlm did not write: entries not named in ``own`` (nor checkpoints,
    with ``checkpoints``), files of the data folder that are not token files, and a data
    "folder" that is a file."""
    found = []
    for entry in folder.iterdir():
        if entry.name == DATA_FOLDER:
            if not entry.is_dir():  # a file where the token files go
                found.append(entry.name)
                continue
            inside = (e.name for e in entry.iterdir() if e.name not in data.OWN_FILES)
            found += [f"{DATA_FOLDER}/{name}" for name in inside]
        elif entry.name not in own and not (checkpoints and checkpoint.is_own(entry.name)):
            found.append(entry.name)
    return sorted(found)


# Everything a run writes in its folder, checkpoints aside.
RUN_ENTRIES = {CONFIG_FILE, STORING, PREPARING, DATA_FOLDER, METRICS, f".{METRICS}.tmp", PICTURE}
RUN_ENTRIES |= {TOKENIZER_FILE, STORING_TOKENIZER}
RUN_ENTRIES.add(lock.LOCK_FILE)


def _check_overwritable(folder: Path) -> None:
    """Raise ValueError unless ``folder`` is a run of octlm's holding nothing else, so that
    ``--overwrite`` may delete it whole."""
    try:
        stored = read_file(folder / CONFIG_FILE)
    except ValueError:
        stored = {}
    if set(stored) != {"model", "run"}:
        raise ValueError(
            f"--overwrite clears only run folders, and {str(folder)!r} has no octlm {CONFIG_FILE}"
        )
    foreign = _foreign_entries(folder, RUN_ENTRIES, checkpoints=True)
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise ValueError(
            f"--overwrite clears only what octlm wrote, and {str(folder)!r} also holds "
            f"{', '.join(foreign[:5])}{more}: "
            "move them out or choose another --out"
        )


def _restore(
    folder, model_config, raw, optimizer, scheduler, scaler, batches, cluster, stopwatch
) -> int:
    """Load the latest checkpoint into everything; the step it was taken after."""
    state = checkpoint.load(checkpoint.latest(folder), model_config)
    distributed.load_full_state(raw, optimizer, state["model"], state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    stopwatch.resume_from(state.get("train_seconds", 0.0))  # before the rate is set from it
    # The checkpoint holds the next step's rate under the schedule it was taken with; a resumed
    # run may go on for another number of steps, whose schedule says otherwise.
    for group, base, factor in zip(
        optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base * factor(scheduler.last_epoch)
    scaler.load_state_dict(state["scaler"])
    batches.load_state_dict(state["data"])
    rng = state["rng"]
    if cluster.rank < len(rng):  # a run resumed on more ranks seeds its new ranks' dropout afresh
        torch.set_rng_state(rng[cluster.rank]["cpu"])
        if cluster.device.type == "cuda" and rng[cluster.rank]["cuda"] is not None:
            torch.cuda.set_rng_state(rng[cluster.rank]["cuda"], cluster.device)
    return state["step"]


def _save(
    folder, step, raw, optimizer, scheduler, scaler, batches, model_config, run, cluster,
    train_seconds,
):  # fmt: skip
    """Write the checkpoint of ``step`` from rank 0 (gathering shards and RNG states first),
    with the ``train_seconds`` spent to reach it."""
    model_state, optimizer_state = distributed.full_state(raw, optimizer)
    cuda = cluster.device.type == "cuda"
    rng = cluster.gather(
        {
            "cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(cluster.device) if cuda else None,
        }
    )
    _on_main(cluster, lambda: checkpoint.save(
        folder, step,
        {
            "model_config": asdict(model_config), "run": asdict(run), "world": cluster.world,
            "model": model_state, "optimizer": optimizer_state,
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
            "data": batches.state_dict(), "rng": rng, "train_seconds": train_seconds,
        },
        keep=run.keep,
    ))  # fmt: skip


def _loss(model: nn.Module, micro: data.Batch, share: float, cluster: Cluster) -> Tensor:
    """This rank's part of the batch's mean loss: its micro-batch's summed token losses over
    ``share``, the targets the whole batch counts per data rank (gradients are averaged over
    data ranks, so the parts add up to the mean)."""
    if cluster.mode == "context":
        return context_parallel_loss(model, micro.inputs, micro.targets) * (
            micro.targets.numel() / share
        )
    logits = model(micro.inputs, micro.document_ids)  # (b, T, V)
    total = F.cross_entropy(
        logits.float().flatten(0, 1), micro.targets.flatten(), ignore_index=data.IGNORED,
        reduction="sum",
    )  # fmt: skip
    return total / share


def _micro_batches(batch: data.Batch, run: RunConfig, cluster: Cluster):
    """This rank's rows of a global batch, cut into ``accumulate`` equal micro-batches, and the
    share of the batch's counted targets each rank's losses are divided by."""
    share = int((batch.targets != data.IGNORED).sum()) / cluster.data_ranks
    rows = [None if part is None else cluster.rows(part).chunk(run.accumulate) for part in batch]
    for index in range(run.accumulate):
        parts = (None if part is None else part[index].to(cluster.device) for part in rows)
        yield data.Batch(*parts), share  # (b, T) each


def _step(model, raw, batch, optimizer, scaler, autocast, run, cluster):
    """One optimizer step on this rank's part of the global batch; (loss, grad norm, lr)."""
    device = cluster.device
    total = torch.zeros((), device=device)
    for index, (micro, share) in enumerate(_micro_batches(batch, run, cluster)):
        with distributed.gradient_sync(model, enabled=index == run.accumulate - 1):
            with autocast:
                loss = _loss(model, micro, share, cluster)
            scaler.scale(loss).backward()
        total += loss.detach()
    distributed.finish_gradients(raw, cluster)
    scaler.unscale_(optimizer)
    grad_norm = nn.utils.clip_grad_norm_(raw.parameters(), run.clip or math.inf)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    lr = optimizer.param_groups[0]["lr"]
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return total, grad_norm, lr


def _tokens_per_byte(batches: list[data.Batch], token_bytes: Tensor) -> float:
    """The targets ``batches`` count per byte those targets stand for (``token_bytes (V,)``
    per token): the factor from a loss per token to a loss per byte (1.0 for byte tokens)."""
    targets = torch.cat([batch.targets.flatten() for batch in batches])  # (N,)
    counted = targets[targets != data.IGNORED]  # (n,)
    return len(counted) / int(token_bytes[counted].sum())


@torch.no_grad()
def _evaluate(
    model, raw, validation, tokens_per_byte, tokenizer, autocast, run, model_config, cluster
):
    """Mean loss per token over the fixed validation batches, in bits per byte (the summed
    token losses over the bytes they cover: ``tokens_per_byte``), and a greedy sample."""
    model.eval()
    losses = []
    for batch in validation:  # (B, T) each
        loss = 0.0
        for micro, share in _micro_batches(batch, run, cluster):
            with autocast:
                loss += cluster.total(_loss(model, micro, share, cluster)).item()
        losses.append(loss)
    model.train()
    val_loss = sum(losses) / len(losses)  # every batch counts as many targets
    sampler = _sampling_model(raw, model_config, cluster)
    text = (
        generate_text(sampler, run.prompt, run.sample_tokens, tokenizer=tokenizer)
        if sampler is not None
        else None
    )
    return val_loss, val_loss * tokens_per_byte / LN2, text


def _sampling_model(raw: OctLM, model_config: ModelConfig, cluster: Cluster) -> OctLM | None:
    """A model that can decode in this process, on rank 0 (None elsewhere).

    Sharded (FSDP) or ring-attention models need every rank for a forward pass, so rank 0
    decodes with a plain copy built from the gathered weights.
    """
    if cluster.mode in ("single", "ddp"):
        return raw if cluster.is_main else None
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(raw, options=options)  # a collective
    if not cluster.is_main:
        return None
    copy = OctLM(single_process(model_config))
    copy.load_state_dict(state)
    return copy.to(cluster.device)


def _recompute_blocks(model: OctLM) -> None:
    """Activation checkpointing: each block keeps only its input and recomputes in backward.

    The block's ``forward`` is wrapped in place, so parameter names (and checkpoints) stay
    those of the plain model.
    """
    for block in model.blocks:
        block.forward = functools.partial(recompute, block.forward, use_reentrant=False)


def _announce(
    summary: dict, model_config: ModelConfig, run: RunConfig, cluster: Cluster, start: int
) -> None:
    parameters = parameter_count(model_config)
    print(
        f"data {summary['source']} ({summary['glob']}): "
        f"train {summary['train_documents']} documents, {summary['train_bytes']:,} bytes; "
        f"validation {summary['val_documents']} documents, {summary['val_bytes']:,} bytes"
        + (f"; {summary['empty_skipped']} empty files skipped" if summary["empty_skipped"] else "")
    )
    if summary["tokenizer"] != "bytes":
        print(
            f"tokens: {summary['tokenizer']} of {summary['vocab_size']:,}; train "
            f"{summary['train_tokens']:,} ({summary['train_bytes'] / summary['train_tokens']:.2f} "
            f"bytes each), validation {summary['val_tokens']:,}"
        )
    print(
        f"model {parameters / 1e6:.2f}M parameters, attention {model_config.attention}; "
        f"{cluster.world} process(es), {cluster.mode}, {cluster.device}, {run.dtype}; "
        f"batch {run.batch} x {run.length} tokens{', packed' if run.pack else ''}, "
        f"steps {start + 1}..{run.steps or ''}"
        + (f", time budget {run.time_budget}" if run.time_budget else "")
    )


@contextlib.contextmanager
def _stop_on_signals():
    """``{"signal": name or None, "armed": bool}``. Once ``armed`` (training has begun), SIGINT,
    SIGTERM and SIGHUP (a closed terminal or ssh session) set ``signal`` and the loop stops
    after its step; before, they raise :class:`Interrupted`, so preparing the data stops at
    once (its half-written files go)."""
    stop = {"signal": None, "armed": False}
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(signum, _frame):
        if not stop["armed"]:
            raise Interrupted(signum)
        stop["signal"] = signal.Signals(signum).name

    stopping = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {s: signal.signal(s, handler) for s in stopping}
    try:
        yield stop
    finally:
        for s, old in previous.items():
            signal.signal(s, old)
