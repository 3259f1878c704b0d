"""Model-level experiments: the whole model's logits and gradients, cached decoding, greedy
generation and a short training run, through every single-process implementation."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor

from octlm.attention import IMPLEMENTATIONS
from octlm.equality import GRADIENT_FACTOR, judge, max_abs_diff
from octlm.lab.verify.cases import Case, outcome, record
from octlm.lab.verify.loss_curve import loss_curve
from octlm.lab.verify.plan import Plan
from octlm.model import KVCache, ModelConfig, OctLM

# The implementations one process can run; ring is checked in its own distributed tests.
SINGLE_PROCESS = tuple(name for name, impl in IMPLEMENTATIONS.items() if not impl.distributed)
# Two float32 loss curves are "the same" when they differ by what float32 rounding explains:
# over 20 steps about 1e-6 relative, the distance of naive in float32 from naive in float64,
# which each record carries beside it. 1e-4 leaves room for other machines' rounding, while a
# wrong gradient moves a curve by about 1e-2.
TRAINING_TOLERANCE = 1e-4


def _weights(config: ModelConfig) -> dict:
    """A fresh model's state dict from seed 0, leaving the caller's random state alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return OctLM(config).state_dict()


def _model(config: ModelConfig, attention: str, state: dict, device: str, dtype: torch.dtype):
    """``OctLM`` with ``state``'s weights, running ``attention``, in eval mode."""
    model = OctLM(replace(config, attention=attention))
    model.load_state_dict(state)
    return model.to(device, dtype).eval()


def _model_case(plan: Plan, config: ModelConfig, length: int) -> Case:
    return Case(
        length,
        kv_heads=config.n_kv_heads,
        heads=config.n_heads,
        head_size=config.head_size,
        batch=plan.model_batch,
        window=config.window,
        block=config.block,
    )


def model_equivalence(plan: Plan, device: str, dtypes: Sequence[torch.dtype]) -> Iterator[dict]:
    """The whole model, identical weights, through sdpa, tiled and auto vs naive: logits and
    every parameter's gradient of the cross-entropy, at each number of KV heads
    (``max_abs_diff``: the logits' largest difference from naive's). Gradients are judged
    parameter by parameter; the record names the worst one."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(256, (plan.model_batch, plan.model_length + 1), generator=generator)
    inputs, targets = tokens[:, :-1].to(device), tokens[:, 1:].to(device)
    for kv_heads in plan.kv_heads:
        config = ModelConfig(**plan.model, n_kv_heads=kv_heads, attention="naive")
        state = _weights(config)
        case = _model_case(plan, config, plan.model_length)
        reference = _logits_and_grads(
            _model(config, "naive", state, device, torch.float64), inputs, targets
        )
        for dtype in dtypes:
            base = _logits_and_grads(_model(config, "naive", state, device, dtype), inputs, targets)
            for name in SINGLE_PROCESS:
                if name == "naive":
                    continue  # the base
                model = _model(config, name, state, device, dtype)
                logits, grads = _logits_and_grads(model, inputs, targets)
                verdict = judge(logits, base[0], reference[0])
                diff = max_abs_diff(logits, base[0])
                yield record("model logits", name, "naive", case, dtype, verdict, diff)
                verdicts = {
                    parameter: judge(
                        grad, base[1][parameter], reference[1][parameter], factor=GRADIENT_FACTOR
                    )
                    for parameter, grad in grads.items()
                }
                worst = max(verdicts, key=lambda p: verdicts[p].error / verdicts[p].tolerance)
                passed = all(v.passed for v in verdicts.values())
                diff = max(max_abs_diff(grad, base[1][p]) for p, grad in grads.items())
                yield record(
                    "model parameter gradients (worst parameter)",
                    name,
                    "naive",
                    case,
                    dtype,
                    replace(verdicts[worst], passed=passed),
                    diff,
                    parameter=worst,
                    parameters=len(verdicts),
                )


def _logits_and_grads(model: OctLM, inputs: Tensor, targets: Tensor):
    logits = model(inputs)  # (B, T, V)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def decoding(plan: Plan, device: str, dtypes: Sequence[torch.dtype]) -> Iterator[dict]:
    """KV-cache decoding (a prompt, then one token per call) gives the logits of one full
    forward, for each implementation; and greedy generation picks the same tokens in every
    implementation, each the argmax of a full forward over the sequence so far (float32)."""
    length = plan.prompt_length + plan.new_tokens
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(256, (plan.model_batch, length), generator=generator).to(device)
    prompt = tokens[:, : plan.prompt_length]
    for window in (0, plan.prompt_length // 2 + 1):
        config = ModelConfig(**plan.model, n_kv_heads=2, window=window, attention="naive")
        state = _weights(config)
        case = _model_case(plan, config, length)
        with torch.no_grad():
            reference = _model(config, "naive", state, device, torch.float64)(tokens)
            for dtype in dtypes:
                base = _model(config, "naive", state, device, dtype)(tokens)
                for name in SINGLE_PROCESS:
                    model = _model(config, name, state, device, dtype)
                    full = model(tokens)  # (B, T, V)
                    cached = _cached_logits(model, tokens, plan.prompt_length)
                    verdict = judge(cached, base, reference)
                    yield record(
                        "cached decoding logits vs one full forward",
                        f"{name} cached",
                        f"{name} full forward",
                        case,
                        dtype,
                        verdict,
                        max_abs_diff(cached, full),
                        prompt_length=plan.prompt_length,
                    )
            yield from _greedy(plan, config, state, prompt, device, case)


def _cached_logits(model: OctLM, tokens: Tensor, prompt_length: int) -> Tensor:
    """Logits ``(B, T, V)`` from a prefill of the prompt, then one token per call."""
    cache = KVCache(model.config)
    logits = [model(tokens[:, :prompt_length], cache=cache)]
    for position in range(prompt_length, tokens.shape[1]):
        logits.append(model(tokens[:, position : position + 1], cache=cache))
    return torch.cat(logits, dim=1)


def _greedy(
    plan: Plan, config: ModelConfig, state: dict, prompt: Tensor, device: str, case: Case
) -> Iterator[dict]:
    """Greedy tokens in float32: equal across implementations and to full-forward argmaxes."""
    generated = {}
    for name in SINGLE_PROCESS:
        model = _model(config, name, state, device, torch.float32)
        sequence = model.generate(prompt, plan.new_tokens)  # (B, P + N)
        argmax = model(sequence[:, :-1])[:, plan.prompt_length - 1 :].argmax(dim=-1)  # (B, N)
        generated[name] = (sequence, int((argmax != sequence[:, plan.prompt_length :]).sum()))
    for name, (sequence, mismatched) in generated.items():
        differing = int((sequence != generated["naive"][0]).sum())
        yield outcome(
            "greedy tokens: generate == full-forward argmax, and == naive's generate",
            f"{name} generate",
            "naive generate",
            case,
            torch.float32,
            mismatched == 0 and differing == 0,
            mismatched_tokens=mismatched,
            tokens_differing_from_naive=differing,
            new_tokens=plan.new_tokens,
        )


def training(plan: Plan, device: str, dtypes: Sequence[torch.dtype]) -> Iterator[dict]:
    """The same RNG seed, weights and batches give the same float32 loss curve through every
    attention. ``loss_curve`` runs on the CPU, whatever ``device`` is."""
    config = ModelConfig(**plan.model, n_kv_heads=2, attention="naive")
    case = replace(_model_case(plan, config, plan.train_length), batch=plan.train_batch)
    options = dict(steps=plan.train_steps, batch=plan.train_batch, length=plan.train_length)
    reference = loss_curve(config, dtype=torch.float64, **options)
    curves = {
        name: loss_curve(replace(config, attention=name), **options) for name in SINGLE_PROCESS
    }
    naive_rounding = _relative(curves["naive"], reference)  # float32 against float64
    for name, curve in curves.items():
        relative = _relative(curve, curves["naive"])
        yield outcome(
            f"loss curve, {plan.train_steps} steps: max relative difference from naive float32 "
            f"<= {TRAINING_TOLERANCE:g} (what float32 rounding explains)",
            name,
            "naive",
            case,
            torch.float32,
            relative <= TRAINING_TOLERANCE,
            loss_relative_difference=relative,
            loss_tolerance=TRAINING_TOLERANCE,
            naive_float32_vs_float64=naive_rounding,
            device="cpu",
            steps=plan.train_steps,
            losses=curve,
            reference_losses=reference,
        )


def _relative(curve: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(curve, reference, strict=True))
