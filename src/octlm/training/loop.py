"""The training loop: a run's state (:class:`Training`) stepped to the end, with records,
evaluations and checkpoints; the run folder around it is :mod:`octlm.training.folder`'s.

One optimizer step draws the global batch ``(B, T)`` (the same on every rank): random windows,
or with ``pack`` rows of whole documents kept apart by ``document_ids``. It keeps this rank's
rows (or, under context parallelism, all rows and this rank's positions), cuts them into
``accumulate`` micro-batches, and adds their gradients; then clipping, the optimizer, the
schedule (over the steps, or over the training time of a ``time_budget``, which also ends the
run).
The loss is the mean over the targets the global batch counts (packing ignores some), so
accumulation and ranks leave it unchanged. Losses per byte (bits) divide the summed token
losses by the bytes those tokens stand for, so runs with other tokenizers compare.
Each evaluation names the run's best checkpoint (the lowest validation loss so far, in
``metrics.jsonl``), which the checkpoints kept always include; when validation has risen
(:func:`octlm.training.metrics.risen`) the run says so, and with ``early_stop`` it ends there.
Every source of randomness is seeded and checkpointed (weights, batch positions, dropout), so
on CPU in float32 a run resumed from step ``k`` repeats the uninterrupted run's losses exactly.
"""

from __future__ import annotations

import functools
import math
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.checkpoint import checkpoint as recompute

from octlm import signals
from octlm.attention import implementation
from octlm.chatml import IM_END
from octlm.context_parallel import context_parallel_loss
from octlm.model import ModelConfig, OctLM
from octlm.progress import Progress
from octlm.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer
from octlm.training import checkpoint, distributed, tokens
from octlm.training import folder as run_folder
from octlm.training.allocator import keep_freed_memory
from octlm.training.base import grown, is_run, step_of, tokenizer_of
from octlm.training.batches import IGNORED, Batch, Batches, PackedBatches, evaluation_batches
from octlm.training.budget import Stopwatch
from octlm.training.compiled import CompiledLoss, compiles_here
from octlm.training.config import (
    TRAINING_DTYPES,
    RunConfig,
    imported_tokenizer,
    parameter_count,
    single_process,
)
from octlm.training.distributed import Cluster
from octlm.training.folder import DATA_FOLDER
from octlm.training.metrics import (
    RISE,
    Metrics,
    best_of,
    peak_memory,
    plot,
    recorded_evaluations,
    risen,
    risen_line,
)
from octlm.training.optim import make_optimizer, make_scheduler
from octlm.training.precision import AUTO, resolve_dtype
from octlm.training.sample import generate_text
from octlm.training.utilisation import flops_per_token, peak

LN2 = math.log(2)
# Ctrl-C, and a closed terminal or ssh session, end a run after its step as SIGTERM does.
STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
OPENING = 8  # tokens of held-out text that prompt the evaluation sample without --prompt


@dataclass(frozen=True)
class Outcome:
    """Where a run ended: the step reached, its last evaluation, why it stopped."""

    folder: Path
    step: int
    val_loss: float | None  # nats per token
    val_bits_per_byte: float | None
    val_step: int | None  # the step of that evaluation
    stopped_by: str | None  # the signal that ended the run early, None if it ran to the end
    rank: int  # this process's rank: 0 speaks for the run
    best_step: int | None = None  # the kept checkpoint of lowest validation loss
    stopped_early: bool = False  # ended by early_stop: validation had risen


class Evaluation(NamedTuple):
    """The validation batches' mean loss, per token (nats) and per byte (bits), and a sample."""

    val_loss: float
    val_bits_per_byte: float
    sample: str | None


def train(
    model_config: ModelConfig,
    run: RunConfig,
    out: str | Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    clock: Callable[[], float] = time.monotonic,
    given: frozenset = frozenset(),
) -> Outcome:
    """Train ``OctLM(model_config)`` as ``run`` says, keeping everything in the folder ``out``.

    A new run refuses a non-empty ``out`` unless ``overwrite``; ``resume`` continues from the
    latest checkpoint there. One run at a time holds ``out`` (:mod:`octlm.training.lock`); a
    second start or resume is refused before it reads or writes anything there. Under torchrun
    every process calls this; rank 0 holds the folder and writes the files.
    SIGINT, SIGTERM and SIGHUP end the run after the current step, with a checkpoint; before
    the first step they raise :class:`octlm.signals.Stopped` (Ctrl-C: ``KeyboardInterrupt``):
    nothing was trained, and the next start clears what was prepared.
    ``clock`` (seconds) measures the training time that ``run.time_budget`` spends.
    A new run's ``--tokenizer auto`` is settled by rank 0 from the corpus
    (:mod:`octlm.training.recipe`), keeping the fields named in ``given`` (those the user set).
    On CPU the process keeps large freed blocks for reuse (:mod:`octlm.training.allocator`).
    """
    if run.init_from is not None and not resume:  # the run keeps its weights' tokenizer
        run = imported_tokenizer(run)
    cluster = distributed.setup(run.device, fsdp=run.fsdp, context_parallel=run.context_parallel)
    if cluster.device.type == "cpu":
        keep_freed_memory()
    # auto values resolved from rank 0's hardware, stored as resolved; the reasons are said
    chosen = {"dtype": run.dtype == AUTO}
    run = replace(run, dtype=cluster.share(resolve_dtype(run.dtype, cluster.device)))
    compiles, chosen["compile"] = compiles_here(run, cluster.device)
    run = replace(run, compile="on" if cluster.share(compiles) else "off")
    folder = Path(out)
    state = None
    try:
        with signals.stop_on_signals(STOPPING) as stop, run_folder.hold(folder, cluster):
            _check_run(model_config, run, cluster)
            summary, model_config, run, chosen["tokenizer"] = cluster.on_main(
                lambda: run_folder.prepare(
                    folder, model_config, run, resume, overwrite, progress, given
                )
            )
            _check_run(model_config, run, cluster)  # as auto settled it
            state = Training.build(model_config, run, folder, cluster, clock, resume)
            # the machines' peak, measured (once a host, then cached) before the clock starts
            peaks = cluster.gather(peak(cluster.device, run.dtype))
            chosen["peak"] = None if None in peaks else sum(peaks)
            return _loop(state, summary, resume, progress, stop, chosen)
    finally:
        if state is not None:  # DDP's reducer holds the process group: it goes first
            state.unwrap()
        distributed.teardown(cluster)


def _loop(
    state: Training, summary: dict, resume: bool, progress: bool, stop: signals.Stop, chosen: dict
) -> Outcome:
    """Step until the run's steps or budget are done or a signal comes: records every
    ``log_every`` steps, checkpoints and evaluations at theirs and at the end."""
    run, cluster, folder, stopwatch = state.run, state.cluster, state.folder, state.stopwatch
    metrics = Metrics(folder, cluster.device, enabled=cluster.is_main)
    start = _begin(state, metrics, summary, resume, stop, chosen)
    bar = Progress(
        "training", run.steps, " steps", initial=start, enabled=progress and cluster.is_main
    )
    flops = flops_per_token(state.model_config, run.length)
    began, tokens_seen = time.perf_counter(), 0
    last_eval, evaluated, stopped_by, step, early = None, None, None, start, False
    stopwatch.start()
    for step in range(start + 1, (run.steps or sys.maxsize) + 1):
        batch = state.batches.next(run.batch)  # (B, T) each, the same on every rank
        loss, grad_norm, lr = state.step(batch)
        if resume and step == start + 1 and cluster.is_main:
            # Its first step worked: the run keeps what the flags changed (more steps, another
            # device or attention) for the next --resume; one failing before kept config.json.
            run_folder.store_config(folder, state.model_config, run)
        bar.update()
        tokens_seen += run.batch * run.length
        signalled = cluster.any(stop.signal is not None)
        spent = run.time_budget is not None and stopwatch.elapsed >= run.budget_seconds
        final = step == run.steps or signalled or spent
        train_loss = None
        if step % run.log_every == 0 or final:
            train_loss = cluster.total(loss).item()
            rate = tokens_seen / (time.perf_counter() - began)
            share = {} if chosen["peak"] is None else {"mfu": rate * flops / chosen["peak"]}
            metrics.write(
                "train_step",
                step=step,
                loss=train_loss,
                lr=lr,
                grad_norm=grad_norm.item(),
                bits_per_byte=train_loss * state.tokens_per_byte([batch]) / LN2,
                tokens_per_second=rate,
                model_flops_per_second=rate * flops,
                **share,
                train_seconds=stopwatch.elapsed,
                **peak_memory(cluster.device),
            )
            mfu = {"mfu": f"{100 * share['mfu']:.0f}%"} if share else {}
            bar.show(
                loss=f"{train_loss:.3f}", tok_s=f"{rate:,.0f}", **mfu, **_budget(run, stopwatch)
            )
            began, tokens_seen = time.perf_counter(), 0
        # Before the evaluation: an evaluation that fails (memory, a full disk) loses no step.
        saved = step % run.checkpoint_every == 0 or final
        if saved:
            state.save(step)
        # The end's evaluation, unless the step before had one (the figure would repeat it).
        ending = (step == run.steps or spent) and evaluated != step - 1
        if step % run.eval_every == 0 or ending:
            train_loss = cluster.total(loss).item() if train_loss is None else train_loss
            last_eval = _evaluate(state, metrics, bar, step, train_loss, saved)
            evaluated, saved = step, saved or state.best == step
            began, tokens_seen = time.perf_counter(), 0  # evaluation is not training time
            early = _risen(state, bar)
            if early and not saved:  # the run ends here: its last checkpoint is this step's
                state.save(step)
        if early:
            break
        if signalled or spent:
            if not spent and step != run.steps:  # a signal in the last step ends nothing early
                stopped_by = stop.signal or "a signal on another rank"
            break
    bar.close()
    if cluster.is_main and stopped_by:
        print(f"stopped by {stopped_by} after step {step}; continue with --resume")
    if cluster.is_main and state.best is not None:
        best = best_of(state.evaluations)
        print(
            f"best checkpoint: step {best['step']}, {best['val_bits_per_byte']:.3f} bits per "
            "byte (octlm sample and octlm export take it)"
        )
    val_loss, val_bits_per_byte, _sample = last_eval or (None, None, None)
    return Outcome(
        folder=folder,
        step=step,
        val_loss=val_loss,
        val_bits_per_byte=val_bits_per_byte,
        val_step=evaluated,
        stopped_by=stopped_by,
        rank=cluster.rank,
        best_step=state.best,
        stopped_early=early,
    )


def _begin(
    state: Training, metrics: Metrics, summary: dict, resume: bool, stop: signals.Stop, chosen: dict
) -> int:
    """Restore a resumed run and launch the model, then defer signals to the end of a step and
    announce the run; the step it starts after."""
    start = 0
    if resume:
        start = state.restore()
        _check_more_to_do(state.run, state.folder, start, state.stopwatch.elapsed)
        metrics.forget_after(start)
        # The evaluations so far, which name the best checkpoint: rank 0's records, shared.
        folder, cluster = state.folder, state.cluster
        state.evaluations = cluster.share(cluster.on_main(lambda: recorded_evaluations(folder)))
        best = best_of(state.evaluations)
        state.best = None if best is None else best["step"]
    state.launch()
    stop.defer()  # from here a signal ends the run after a step, with a checkpoint
    if state.cluster.is_main:
        if not resume:  # everything before the first step worked: the folder is now a run
            run_folder.begun(state.folder, state.model_config, state.run)
        _announce(summary, state.model_config, state.run, state.cluster, start, chosen)
    return start


def _evaluate(
    state: Training, metrics: Metrics, bar: Progress, step: int, train_loss: float, saved: bool
) -> Evaluation:
    """Evaluate after ``step``: its record, naming the best checkpoint (written now if this
    step is the best and had none), a line under the progress bar, the loss picture."""
    evaluation = state.evaluate()
    state.evaluations.append(
        {
            "step": step,
            "val_loss": evaluation.val_loss,
            "val_bits_per_byte": evaluation.val_bits_per_byte,
        }
    )
    best = best_of(state.evaluations)
    best_step = None if best is None else best["step"]
    if best_step == step and not saved:
        state.save(step)
    metrics.write(
        "eval",
        step=step,
        loss=train_loss,
        **evaluation._asdict(),
        train_seconds=state.stopwatch.elapsed,
        best_step=best_step,
    )
    state.best = best_step  # from now on kept: the records name it; the one before may go
    state.cluster.on_main(lambda: checkpoint.prune(state.folder, state.run.keep, best_step))
    if state.cluster.is_main:
        bar.write(
            f"step {step}: val loss {evaluation.val_loss:.4f} nats per token, "
            f"{evaluation.val_bits_per_byte:.3f} bits per byte\n"
            f"  sample: {evaluation.sample!r}"
        )
        plot(state.folder)
    return evaluation


def _risen(state: Training, bar: Progress) -> bool:
    """Say once per best when validation has risen (over ``early_stop`` evaluations, else
    :data:`RISE`); whether the run ends here (``early_stop``)."""
    count = state.run.early_stop or RISE
    best = risen(state.evaluations, count)
    if best is None or state.risen_after == best["step"]:
        return False
    state.risen_after = best["step"]
    ends = state.run.early_stop is not None
    if state.cluster.is_main:
        then = f"the run ends here (--early-stop {count})" if ends else f"or --early-stop {count}"
        bar.write(f"{risen_line(state.evaluations, count)}; {then}")
    return ends


def _budget(run: RunConfig, stopwatch: Stopwatch) -> dict[str, str]:
    """The progress bar's view of a time budget: the share spent and the time left."""
    if run.time_budget is None:
        return {}
    left = max(run.budget_seconds - stopwatch.elapsed, 0.0)
    minutes, seconds = divmod(round(left), 60)
    return {
        "budget": f"{stopwatch.elapsed / run.budget_seconds:.0%}",
        "left": f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s",
    }


@dataclass
class Training:
    """One rank's run in progress: the model, its optimizer, schedule and scaler, the data and
    the training clock. :meth:`step`, :meth:`evaluate`, :meth:`save` and :meth:`restore` act on
    it; a checkpoint holds all of it, so a resumed run goes on exactly."""

    model_config: ModelConfig
    run: RunConfig
    folder: Path
    cluster: Cluster
    raw: OctLM  # the plain (or FSDP-sharded) model: checkpoints and sampling read it
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    batches: Batches
    validation: list[Batch]
    tokenizer: ByteTokenizer | BPETokenizer
    token_bytes: Tensor  # (V,) bytes each token stands for
    stopwatch: Stopwatch  # training time, over every launch of the run
    autocast: torch.autocast
    opening: str = "\n"  # the evaluation sample's prompt without --prompt: held-out text's start
    question: list[int] | None = None  # a chat run's: a held-out conversation's first prompt
    model: nn.Module | None = None  # what a step calls (DDP): set by launch
    loss: CompiledLoss | None = None  # the summed token loss, compiled or not: set by launch
    # The run's evaluations ({step, val_loss, val_bits_per_byte}) and the step of the best
    # that its records name, whose checkpoint :meth:`save` keeps.
    evaluations: list[dict] = field(default_factory=list)
    best: int | None = None
    risen_after: int | None = None  # the best whose rise was said

    @classmethod
    def build(cls, model_config, run, folder, cluster, clock, resume: bool) -> Training:
        """A run's state at step 0, from the prepared folder's token files and tokenizer."""
        split_tokens = {
            split: tokens.load_tokens(folder / DATA_FOLDER, split, run.length)
            for split in tokens.SPLITS
        }
        tokenizer = load_tokenizer(folder)  # checked against the run by prepare
        torch.manual_seed(run.seed)  # the same initial weights on every rank
        raw = OctLM(model_config).to(cluster.device)
        if run.init_from is not None and not resume:  # fine-tuning: the base's weights
            # its weights, in the run's model (another vocabulary or max_length: its config)
            raw.load_state_dict(
                _base_weights(run, model_config) | {"_extra_state": raw.get_extra_state()}
            )
        if run.checkpoint_activations:
            _recompute_blocks(raw)
        distributed.shard(raw, cluster)
        optimizer = make_optimizer(
            raw,
            run.lr,
            run.weight_decay,
            optimizer=run.optimizer,
            muon_lr=run.muon_lr,
            precision=TRAINING_DTYPES["bfloat16" if run.dtype == "bfloat16" else "float32"],
        )
        stopwatch = Stopwatch(clock)
        scheduler = make_scheduler(
            optimizer,
            warmup=run.warmup,
            steps=run.steps,
            min_ratio=run.min_lr_ratio,
            budget=run.budget_seconds,
            elapsed=lambda: stopwatch.elapsed,
        )
        scaler = torch.amp.GradScaler(cluster.device.type, enabled=run.dtype == "float16")
        data = folder / DATA_FOLDER
        supervised = {split: tokens.load_mask(data, split) for split in tokens.SPLITS}
        if run.loss == "all":
            supervised = dict.fromkeys(tokens.SPLITS)
        starts = tokens.load_starts(data, "train") if run.pack else None
        batches = (
            PackedBatches(
                split_tokens["train"], run.length, run.seed, starts, supervised=supervised["train"]
            )
            if run.pack
            else Batches(
                split_tokens["train"], run.length, run.seed, supervised=supervised["train"]
            )
        )
        if run.chat:  # whole held-out conversations, packed as training packs them
            held = PackedBatches(
                split_tokens["val"],
                run.length,
                run.seed,
                tokens.load_starts(data, "val"),
                supervised=supervised["val"],
            )
            validation = [held.next(run.batch) for _ in range(run.eval_batches)]
        else:
            validation = evaluation_batches(
                split_tokens["val"], run.length, run.batch, run.eval_batches
            )
        torch.manual_seed(run.seed + cluster.rank)  # dropout differs between ranks' rows
        autocast = torch.autocast(
            cluster.device.type, dtype=TRAINING_DTYPES[run.dtype], enabled=run.dtype != "float32"
        )
        return cls(
            model_config=model_config,
            run=run,
            folder=folder,
            cluster=cluster,
            raw=raw,
            optimizer=optimizer,
            scheduler=scheduler,
            scaler=scaler,
            batches=batches,
            validation=validation,
            tokenizer=tokenizer,
            token_bytes=tokenizer.token_bytes,
            stopwatch=stopwatch,
            autocast=autocast,
            opening=_opening(split_tokens["val"], tokenizer),
            question=_question(data, tokenizer) if run.chat else None,
        )

    def launch(self) -> None:
        """Wrap the model for the steps (DDP), and compile their loss with ``compile``."""
        self.model = distributed.wrap(self.raw, self.cluster)
        compiling = self.run.compile == "on"
        if compiling and self.cluster.world > 1:  # DDP, FSDP: dynamo splits at their buckets
            self.model, compiling = torch.compile(self.model), False
        self.loss = CompiledLoss(_summed_loss, on=compiling, device=self.cluster.device)

    def unwrap(self) -> None:
        """Let go of what :meth:`launch` wrapped, before the process group is destroyed
        (:func:`octlm.training.distributed.teardown` says why)."""
        self.model = self.loss = None

    def step(self, batch: Batch) -> tuple[Tensor, Tensor, float]:
        """One optimizer step on this rank's part of the global ``batch`` (B, T), then the
        clock and the schedule; (loss, grad norm, the step's learning rate)."""
        run, cluster = self.run, self.cluster
        total = torch.zeros((), device=cluster.device)
        for index, (micro, share) in enumerate(_micro_batches(batch, run, cluster)):
            with distributed.gradient_sync(self.model, enabled=index == run.accumulate - 1):
                with self.autocast:
                    loss = _loss(self.loss, self.model, micro, share, cluster)
                self.scaler.scale(loss).backward()
            total += loss.detach()
        distributed.finish_gradients(self.raw, cluster)
        self.scaler.unscale_(self.optimizer)
        grad_norm = nn.utils.clip_grad_norm_(self.raw.parameters(), run.clip or math.inf)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        lr = self.optimizer.param_groups[0]["lr"]
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        # Under a budget the schedule and the end follow rank 0's clock on every rank.
        self.stopwatch.lap(cluster.share if run.time_budget else None)
        self.scheduler.step()
        return total, grad_norm, lr

    @torch.no_grad()
    def evaluate(self) -> Evaluation:
        """The mean loss per token over the fixed validation batches, in bits per byte too (the
        summed token losses over the bytes they cover), and a greedy sample; off the clock."""
        with self.stopwatch.paused():
            self.model.eval()
            summed, counted = 0.0, 0
            for batch in self.validation:  # (B, T) each
                for micro, share in _micro_batches(batch, self.run, self.cluster):
                    with self.autocast:
                        part = _loss(self.loss.eager, self.model, micro, share, self.cluster)
                    summed += self.cluster.total(part).item() * _counted(batch)
                counted += _counted(batch)
            self.model.train()
            val_loss = summed / max(counted, 1)  # per counted target, over every batch
            sampler = _sampling_model(self.raw, self.model_config, self.cluster)
            text = None
            if sampler is not None and self.question is not None and self.run.prompt is None:
                text = _reply(sampler, self.question, self.run.sample_tokens, self.tokenizer)
            elif sampler is not None:
                text = generate_text(
                    sampler,
                    self.run.prompt or self.opening,
                    self.run.sample_tokens,
                    tokenizer=self.tokenizer,
                )
        bits = val_loss * self.tokens_per_byte(self.validation) / LN2
        return Evaluation(val_loss, bits, text)

    def tokens_per_byte(self, batches: list[Batch]) -> float:
        """The targets ``batches`` count per byte those targets stand for: the factor from a
        loss per token to a loss per byte (1.0 for byte tokens)."""
        targets = torch.cat([batch.targets.flatten() for batch in batches])  # (N,)
        counted = targets[targets != IGNORED]  # (n,)
        return len(counted) / max(int(self.token_bytes[counted].sum()), 1)

    def save(self, step: int) -> None:
        """Write the checkpoint of ``step`` from rank 0 (gathering shards and RNG states first)."""
        model_state, optimizer_state = distributed.full_state(self.raw, self.optimizer)
        cuda = self.cluster.device.type == "cuda"
        rng = self.cluster.gather(
            {
                "cpu": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state(self.cluster.device) if cuda else None,
            }
        )
        state = {
            "model_config": asdict(self.model_config),
            "run": asdict(self.run),
            "world": self.cluster.world,
            "model": model_state,
            "optimizer": optimizer_state,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "data": self.batches.state_dict(),
            "rng": rng,
            "train_seconds": self.stopwatch.elapsed,
        }
        self.cluster.on_main(
            lambda: checkpoint.save(self.folder, step, state, keep=self.run.keep, best=self.best)
        )

    def restore(self) -> int:
        """Load the latest checkpoint into everything; the step it was taken after."""
        state = checkpoint.load(checkpoint.latest(self.folder), self.model_config)
        optimizer, scheduler = self.optimizer, self.scheduler
        distributed.load_full_state(self.raw, optimizer, state["model"], state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        self.stopwatch.resume_from(state.get("train_seconds", 0.0))  # before the rate is set
        # The checkpoint holds the next step's rate under the schedule it was taken with; a
        # resumed run may go on for another number of steps, whose schedule says otherwise.
        for group, base, factor in zip(
            optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
        ):
            group["lr"] = base * factor(scheduler.last_epoch)
        self.scaler.load_state_dict(state["scaler"])
        self.batches.load_state_dict(state["data"])
        rng, rank, device = state["rng"], self.cluster.rank, self.cluster.device
        if rank < len(rng):  # a run resumed on more ranks seeds its new ranks' dropout afresh
            torch.set_rng_state(rng[rank]["cpu"])
            if device.type == "cuda" and rng[rank]["cuda"] is not None:
                torch.cuda.set_rng_state(rng[rank]["cuda"], device)
        return state["step"]


def _check_more_to_do(run: RunConfig, folder: Path, start: int, elapsed: float) -> None:
    """Raise ValueError when a resumed run has no steps or budget left to train."""
    if run.steps is not None and start >= run.steps:
        raise ValueError(
            f"--resume: the run in {str(folder)!r} is at step {start} already and --steps is "
            f"{run.steps}: pass a larger --steps to train it further"
        )
    if run.time_budget is not None and elapsed >= run.budget_seconds:
        raise ValueError(
            f"--resume: the run in {str(folder)!r} has trained for {elapsed:.0f} s "
            f"already and --time-budget is {run.time_budget}: pass a larger --time-budget "
            "to train it further"
        )


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


def _loss(
    summed: Callable, model: nn.Module, micro: Batch, share: float, cluster: Cluster
) -> Tensor:
    """This rank's part of the batch's mean loss: its micro-batch's summed token losses
    (``summed``: :func:`_summed_loss`, compiled or not) over ``share``, the targets the whole
    batch counts per data rank (gradients are averaged over data ranks, so the parts add up to
    the mean)."""
    if cluster.mode == "context":
        return context_parallel_loss(model, micro.inputs, micro.targets) * (
            micro.targets.numel() / share
        )
    return summed(model, micro.inputs, micro.targets, micro.document_ids) / share


def _summed_loss(
    model: nn.Module, inputs: Tensor, targets: Tensor, document_ids: Tensor | None
) -> Tensor:
    """The summed cross-entropy of ``inputs (b, T)`` against ``targets (b, T)``, computed from
    float32 logits; what ``--compile`` compiles, one graph from tokens to the loss."""
    logits = model(inputs, document_ids)  # (b, T, V)
    return F.cross_entropy(
        logits.float().flatten(0, 1),
        targets.flatten(),
        ignore_index=IGNORED,
        reduction="sum",
    )


def _opening(tokens: Tensor, tokenizer) -> str:
    """The start of the held-out text ``tokens (N,)``: its first :data:`OPENING` tokens, cut
    at the first end of text, as text (a newline where that leaves none)."""
    ids = tokens[:OPENING].tolist()
    if tokenizer.end_token in ids:
        ids = ids[: ids.index(tokenizer.end_token)]
    text = tokenizer.decode(ids).decode("utf-8", errors="ignore")
    return text or "\n"


def _micro_batches(batch: Batch, run: RunConfig, cluster: Cluster):
    """This rank's rows of a global batch, cut into ``accumulate`` equal micro-batches, and the
    share of the batch's counted targets each rank's losses are divided by."""
    # a batch without a counted target adds zero: its summed loss over one, never 0 / 0
    share = max(_counted(batch), 1) / cluster.data_ranks
    rows = [None if part is None else cluster.rows(part).chunk(run.accumulate) for part in batch]
    for index in range(run.accumulate):
        parts = (None if part is None else part[index].to(cluster.device) for part in rows)
        yield Batch(*parts), share  # (b, T) each


def _counted(batch: Batch) -> int:
    """The targets a batch's loss counts."""
    return int((batch.targets != IGNORED).sum())


def _base_weights(run: RunConfig, model_config: ModelConfig) -> dict[str, Tensor]:
    """The weights a fine-tune starts from: ``run.init_from``'s (an octlm run's checkpoint, or
    a transformers folder's), their per-token rows those of the run's tokenizer
    (:func:`octlm.training.base.grown`)."""
    if is_run(run.init_from):
        state = run_folder.load_model(run.init_from, step=step_of(run.init_step))[0].state_dict()
    else:
        state = OctLM.from_pretrained(run.init_from).state_dict()
    rows = tokenizer_of(run.init_from).vocab_size
    return grown(state, rows, model_config.vocab_size)


def _question(data: Path, tokenizer) -> list[int]:
    """The first held-out conversation up to its first answer: the ids that prompt a chat
    run's evaluation sample."""
    ids = tokens.load_tokens(data, "val", 1)  # (N,)
    mask = tokens.load_mask(data, "val")  # (N,) the first conversation has an answer
    first = int(mask.nonzero()[0])  # its answer's first token
    return ids[:first].tolist()


def _reply(model: OctLM, question: list[int], count: int, tokenizer) -> str:
    """The model's greedy reply of up to ``count`` tokens to ``question``, as text."""
    end = tokenizer.special_ids[IM_END]
    context = torch.tensor([question[-(model.config.max_length - 1) :]])  # (1, P)
    count = min(count, model.config.max_length - context.shape[1])
    was_training = model.training
    model.eval()
    try:
        drawn = model.generate(context.to(next(model.parameters()).device), count, end_token=end)
    finally:
        model.train(was_training)
    ids = drawn[0, context.shape[1] :].tolist()
    ids = ids[: ids.index(end)] if end in ids else ids
    return tokenizer.decode(ids).decode("utf-8", errors="replace")


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
    summary: dict,
    model_config: ModelConfig,
    run: RunConfig,
    cluster: Cluster,
    start: int,
    chosen: dict,
) -> None:
    """The run's start lines: its data, its tokens, its model and how it runs (``chosen``:
    whether the dtype is --dtype auto's pick for this hardware, why the steps are compiled or
    not, and what --tokenizer auto chose and why)."""
    units = "has" if run.dtype == "bfloat16" else "lacks"
    dtype = f"{run.dtype} (auto: the {cluster.device.type} {units} bfloat16 units)"
    parameters = parameter_count(model_config)
    print(tokens.describe(summary))
    if chosen.get("tokenizer"):
        print(chosen["tokenizer"])
    print(
        f"model {parameters / 1e6:.2f}M parameters, context {model_config.max_length:,} tokens, "
        f"attention {model_config.attention}; "
        f"{cluster.world} process(es), {cluster.mode}, {cluster.device}, "
        f"{dtype if chosen['dtype'] else run.dtype}, "
        f"{'compiled' if run.compile == 'on' else 'eager'} ({chosen['compile']}); "
        f"batch {run.batch} x {run.length} tokens{', packed' if run.pack else ''}, "
        f"steps {start + 1}..{run.steps or ''}"
        + (f", time budget {_as_given(run.time_budget)}" if run.time_budget else "")
    )
    flops = flops_per_token(model_config, run.length)
    peak_said = "not measured" if chosen["peak"] is None else f"{chosen['peak'] / 1e9:,.1f} GFLOP/s"
    print(
        f"{flops / 1e6:,.2f} MFLOP per token; the machines' peak in {run.dtype} on "
        f"{torch.get_num_threads()} thread(s) a process: {peak_said} (MFU is their ratio: "
        "docs/benchmarks.md, 'Share of peak')"
    )


def _as_given(budget: str) -> str:
    """A time budget as written, a bare number marked as the seconds it means."""
    return f"{budget} seconds" if budget.strip().replace(".", "", 1).isdigit() else budget
