"""A small decoder-only language model whose attention runs naive, sdpa, tiled, auto or ring.

tokens -> embedding -> n_layers x [RMSNorm -> attention -> +, RMSNorm -> SwiGLU -> +]
       -> RMSNorm -> logits through the embedding matrix (tied head)

Notation on shape comments: ``B`` batch, ``T`` tokens in this call, ``K`` keys attended (cached
positions plus ``T``), ``C`` width, ``H`` query heads, ``Hkv`` key/value heads, ``D`` head size,
``V`` vocabulary. Grouped-query attention lets ``H // Hkv`` consecutive query heads share one
key/value head (``Hkv = H`` is MHA, ``Hkv = 1`` is MQA); the attention functions read the shared
heads in place, so the model never repeats them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from octlm.attention import IMPLEMENTATIONS, implementation
from octlm.attention.registry import taking
from octlm.attention.tiled.options import DEFAULT_BLOCK, KERNELS, parse_block
from octlm.files import read_model, write_model


def is_int_at_least(value, minimum: int) -> bool:
    """True for a plain int (not a bool) >= ``minimum``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


# ModelConfig fields that say how a model runs, not which weights it has or what they compute:
# every implementation, tile and kernel gives the same function of the same weights, and
# dropout acts only while training. Weights load, a cache serves and a run resumes under any of
# their values.
INTERCHANGEABLE = frozenset({"attention", "block", "kernel", "dropout"})


@dataclass
class ModelConfig:
    """Sizes and the attention implementation; checked on construction.

    ``attention="auto"`` takes, per call, the faster of sdpa and tiled
    (:func:`octlm.attention.route`). ``n_kv_heads`` defaults to ``n_heads`` (MHA). ``block`` and
    ``kernel`` are tiled's (auto's too, for the calls it gives tiled): ``kernel="pytorch"``
    keeps CUDA tensors off the Triton kernel.
    ``window > 0`` lets each position see itself and the ``window - 1`` before it. ``dropout``
    applies to attention weights and residual branches while training; only naive, sdpa
    and auto (through sdpa) have attention dropout. ``tied_head`` computes logits through the
    embedding matrix (else the model has its own ``head``, as imported Llama models may);
    ``mlp_width`` defaults to 8/3 of ``width`` (the parameters of a 4x MLP) rounded up to 8,
    resolved on construction (so ``replace(config, width=w)`` keeps it unless given
    ``mlp_width=None`` too); ``norm_eps`` is every RMSNorm's epsilon. ``qk_norm`` puts an
    RMSNorm (a gain per head dimension, shared by the heads) over each head's queries and keys
    before RoPE, as Qwen3 does: the scores stay bounded whatever the projections grow to.
    """

    vocab_size: int = 256
    width: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int | None = None
    max_length: int = 2048
    attention: str = "auto"
    block: int | tuple[int, int] = DEFAULT_BLOCK
    kernel: str = "auto"
    window: int = 0
    dropout: float = 0.0
    rope_base: float = 10000.0
    tied_head: bool = True
    mlp_width: int | None = None
    norm_eps: float = 1e-6
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads
        for name in ("vocab_size", "width", "n_layers", "n_heads", "n_kv_heads", "max_length"):
            value = getattr(self, name)
            if not is_int_at_least(value, 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.mlp_width is None:  # resolved, so that a config equals its explicit twin
            self.mlp_width = 8 * -(-self.width // 3)
        if not is_int_at_least(self.mlp_width, 1):
            raise ValueError(f"mlp_width must be a positive int or None, got {self.mlp_width!r}")
        if self.width % self.n_heads:
            raise ValueError(f"width ({self.width}) must be a multiple of n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})"
            )
        if self.head_size % 2:
            raise ValueError(
                f"head size width // n_heads = {self.head_size} must be even for rotary "
                f"embeddings; change width ({self.width}) or n_heads ({self.n_heads})"
            )
        implementation(self.attention)  # a ValueError names the choices
        parse_block(self.block)
        if self.kernel not in KERNELS:
            raise ValueError(f"kernel must be one of {KERNELS}, got {self.kernel!r}")
        if not is_int_at_least(self.window, 0):
            raise ValueError(f"window must be an int >= 0 (0 = no window), got {self.window!r}")
        if not isinstance(self.dropout, int | float) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if self.dropout > 0 and not IMPLEMENTATIONS[self.attention].dropout:
            with_dropout = tuple(name for name, impl in IMPLEMENTATIONS.items() if impl.dropout)
            raise ValueError(
                f"dropout={self.dropout} needs attention in {with_dropout}; "
                f"{self.attention!r} has no attention dropout"
            )
        if not isinstance(self.rope_base, int | float) or not self.rope_base > 0:
            raise ValueError(f"rope_base must be a positive number, got {self.rope_base!r}")
        for name in ("tied_head", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        eps = self.norm_eps
        if isinstance(eps, bool) or not isinstance(eps, int | float) or not 0 < eps < math.inf:
            raise ValueError(f"norm_eps must be a positive finite number, got {eps!r}")

    @property
    def head_size(self) -> int:
        return self.width // self.n_heads


def differing_fields(first: ModelConfig, second: ModelConfig) -> list[str]:
    """``"name=a vs b"`` for every field beyond the interchangeable ones in which the configs
    differ."""
    return [
        f"{field.name}={getattr(first, field.name)!r} vs {getattr(second, field.name)!r}"
        for field in fields(ModelConfig)
        if field.name not in INTERCHANGEABLE
        and getattr(first, field.name) != getattr(second, field.name)
    ]


class KVCache:
    """Per-layer keys and values (after RoPE), in buffers allocated once and written in place.

    ``capacity`` is the most positions the cache will take (``max_length`` by default;
    ``generate`` asks for the prompt plus the new tokens). Each layer holds a key and a value
    buffer ``(B, Hkv, S, D)`` with ``S = capacity``, or ``S = min(window, capacity)`` with a
    window: a ring in which position ``p`` lives in slot ``p % S``. ``length`` counts every
    position seen, which is where the next token's RoPE position starts. ``keys[layer]`` and
    ``values[layer]`` are views of the slots that hold positions, ``(B, Hkv, min(length, S),
    D)``; the buffers' tail past them is uninitialised, so they stay private.

    The buffers are allocated at the first call, with that call's batch and the model's dtype
    and device. A call that differs in any of them, would pass ``capacity``, or comes from a
    model of another config (beyond how it runs: attention, block, kernel, dropout) is refused
    before anything is written. The buffers are written in place, so autograd cannot reach
    through a call into the ones before it: the cache is for inference.
    """

    def __init__(self, config: ModelConfig, capacity: int | None = None):
        capacity = config.max_length if capacity is None else capacity
        if not is_int_at_least(capacity, 1) or capacity > config.max_length:
            raise ValueError(
                f"capacity must be an int in [1, max_length={config.max_length}], got {capacity!r}"
            )
        self.config = replace(config)  # a copy: the cache stays bound to what it was made for
        self.capacity = capacity
        self.size = capacity if config.window == 0 else min(config.window, capacity)
        self._keys: list[Tensor] = []  # (B, Hkv, S, D) each
        self._values: list[Tensor] = []
        self.batch: int | None = None
        self.dtype: torch.dtype | None = None
        self.device: torch.device | None = None
        self.length = 0
        self.pending: list[tuple[int, Tensor, Tensor, Tensor]] = []  # ring writes not yet made

    @property
    def keys(self) -> list[Tensor]:
        """Each layer's cached keys ``(B, Hkv, min(length, S), D)``, views in slot order."""
        return [key[:, :, : min(self.length, self.size)] for key in self._keys]

    @property
    def values(self) -> list[Tensor]:
        """Each layer's cached values, as :attr:`keys`."""
        return [value[:, :, : min(self.length, self.size)] for value in self._values]

    def prepare(
        self, config: ModelConfig, tokens: Tensor, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Check that a call of ``tokens (B, T)`` fits this cache; allocate the buffers at the
        first call. Raises ``ValueError`` before anything is written, so a refused call leaves
        the cache as it was."""
        self.pending.clear()  # left by a call that failed part-way
        differences = differing_fields(self.config, config)
        if differences:
            raise ValueError(
                f"this KVCache was made for another model config ({'; '.join(differences)}, "
                "cache vs model): make one with KVCache(model.config)"
            )
        batch, length = tokens.shape
        if self.length + length > self.capacity:
            raise ValueError(
                f"{self.length} cached + {length} new positions exceed the cache's capacity "
                f"of {self.capacity}"
            )
        if self._keys:
            if batch != self.batch:
                raise ValueError(f"cache holds batch {self.batch} but tokens have batch {batch}")
            if (dtype, device) != (self.dtype, self.device):
                raise ValueError(
                    f"cache holds {self.dtype} on {self.device} but the model runs in {dtype} "
                    f"on {device}"
                )
            return
        shape = (batch, config.n_kv_heads, self.size, config.head_size)  # (B, Hkv, S, D)
        layers = range(config.n_layers)
        self._keys = [torch.empty(shape, dtype=dtype, device=device) for _ in layers]
        self._values = [torch.empty_like(key) for key in self._keys]
        self.batch, self.dtype, self.device = batch, dtype, device

    def update(self, layer: int, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Write one chunk's ``(B, Hkv, T, D)`` keys/values at their positions; return the keys
        and values the chunk attends to, ``(B, Hkv, K, D)``, laid out so that the bottom-right
        causal and window rules over them hold."""
        past, length = self.length, key.shape[2]
        keys, values = self._keys[layer], self._values[layer]
        if past + length <= self.size:  # no slot reused yet: slot = position
            keys[:, :, past : past + length] = key
            values[:, :, past : past + length] = value
            return keys[:, :, : past + length], values[:, :, : past + length]  # views
        if length == 1:
            # The full ring holds exactly one window. The new key replaces the one this query
            # can no longer see, and a single query sees every slot, so their order is moot.
            keys[:, :, past % self.size] = key[:, :, 0]
            values[:, :, past % self.size] = value[:, :, 0]
            return keys, values  # (B, Hkv, S, D)
        # A chunk's rows see different keys, so the window - 1 positions before the chunk are
        # laid out in order ahead of it: one copy per chunk, never per decoded token.
        before = torch.arange(max(0, past - self.size + 1), past, device=keys.device) % self.size
        key = torch.cat([keys.index_select(2, before), key], dim=2)  # (B, Hkv, K, D)
        value = torch.cat([values.index_select(2, before), value], dim=2)  # (B, Hkv, K, D)
        # The chunk's last positions, which later calls see, overwrite slots that this call's
        # later layers still read: they are written by advance, once every layer has run.
        kept = min(length, self.size)
        slots = torch.arange(past + length - kept, past + length, device=keys.device) % self.size
        self.pending.append((layer, slots, key[:, :, -kept:], value[:, :, -kept:]))
        return key, value

    def advance(self, length: int) -> None:
        """Close a call of ``length`` positions that has produced its logits: make its deferred
        ring writes and count its positions. A call that fails before then never gets here, so
        the cache keeps what it held before: its keys may lie in slots no later call reads
        (past ``length``, or a full ring's slot of the position that left the window)."""
        for layer, slots, key, value in self.pending:
            self._keys[layer].index_copy_(2, slots, key)
            self._values[layer].index_copy_(2, slots, value)
        self.pending.clear()
        self.length += length


def rope_tables(config: ModelConfig) -> tuple[Tensor, Tensor]:
    """cos and sin ``(max_length, D)`` of each position's rotation angles (half-split layout)."""
    half = torch.arange(0, config.head_size, 2, dtype=torch.float64) / config.head_size
    frequencies = config.rope_base**-half  # (D/2,)
    positions = torch.arange(config.max_length, dtype=torch.float64)
    angles = torch.outer(positions, frequencies).repeat(1, 2)  # (max_length, D)
    dtype = torch.get_default_dtype()
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate each pair ``(x[i], x[i + D/2])`` of ``x (B, heads, T, D)`` by its angle; ``cos``
    and ``sin`` are ``(1, T, D)`` (positions shared by the rows) or ``(B, 1, T, D)``."""
    first, second = x.chunk(2, dim=-1)
    rotated = torch.cat([-second, first], dim=-1)  # (B, heads, T, D)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def attends_in_float32(device: torch.device) -> bool:
    """Whether attention on ``device`` computes in float32 whatever autocast says: under CPU
    autocast, where SDPA's bfloat16 backward is slower than its float32 one by more than
    bfloat16 gains in the matrix products (docs/training.md, 'Precision and memory'), and
    float32 is the more exact. The output projection casts the result back."""
    return device.type == "cpu" and torch.is_autocast_enabled("cpu")


class Attention(nn.Module):
    """Projections, RoPE and one call into ``octlm.attention``; no attention maths here."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.config, self.layer = config, layer
        self.qkv = nn.Linear(
            config.width, (config.n_heads + 2 * config.n_kv_heads) * config.head_size, bias=False
        )
        self.output = nn.Linear(config.width, config.width, bias=False)
        if config.qk_norm:
            self.query_norm = nn.RMSNorm(config.head_size, eps=config.norm_eps)
            self.key_norm = nn.RMSNorm(config.head_size, eps=config.norm_eps)
        self.dropout = nn.Dropout(config.dropout)
        impl = implementation(config.attention)
        tuning = {name: getattr(config, name) for name in impl.tuning if hasattr(config, name)}
        # Causal is bottom-right aligned, so one rule serves a full sequence and a chunk after
        # cached keys: the structure is described, never materialised as a T x K mask.
        self.attend = functools.partial(impl.function, causal=True, window=config.window, **tuning)

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        cache: KVCache | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        batch, length, width = x.shape
        query, key, value = self._project(x, rope)  # (B, H, T, D), (B, Hkv, T, D) x 2
        if cache is not None:
            key, value = cache.update(self.layer, key, value)  # (B, Hkv, K, D) x 2
        documents = {} if document_ids is None else {"document_ids": document_ids}
        dropout_p = self.dropout.p if self.training else 0.0
        in_float32 = attends_in_float32(query.device)
        if in_float32:
            query, key, value = query.float(), key.float(), value.float()
        with torch.autocast("cpu", enabled=False) if in_float32 else contextlib.nullcontext():
            attended = self.attend(query, key, value, dropout_p=dropout_p, **documents)
        attended = attended.transpose(1, 2).reshape(batch, length, width)  # (B, T, C)
        return self.dropout(self.output(attended))

    def _project(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """Query, key and value in heads-first layout, RoPE applied to query and key (after
        their norms, with ``qk_norm``)."""
        batch, length, _ = x.shape
        heads, kv_heads, head_size = (
            self.config.n_heads,
            self.config.n_kv_heads,
            self.config.head_size,
        )
        sizes = (heads * head_size, kv_heads * head_size, kv_heads * head_size)
        query, key, value = self.qkv(x).split(sizes, dim=-1)  # (B, T, H*D), (B, T, Hkv*D) x 2
        query = query.view(batch, length, heads, head_size).transpose(1, 2)  # (B, H, T, D)
        key = key.view(batch, length, kv_heads, head_size).transpose(1, 2)  # (B, Hkv, T, D)
        value = value.view(batch, length, kv_heads, head_size).transpose(1, 2)  # (B, Hkv, T, D)
        if self.config.qk_norm:
            query, key = self.query_norm(query), self.key_norm(key)
        return apply_rope(query, *rope), apply_rope(key, *rope), value


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate = nn.Linear(config.width, config.mlp_width, bias=False)
        self.up = nn.Linear(config.width, config.mlp_width, bias=False)
        self.down = nn.Linear(config.mlp_width, config.width, bias=False)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.down(F.silu(self.gate(x)) * self.up(x)))


class Block(nn.Module):
    """Pre-norm transformer block: attention then MLP, each added to the residual stream."""

    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.width, eps=config.norm_eps)
        self.attention = Attention(config, layer)
        self.mlp_norm = nn.RMSNorm(config.width, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        cache: KVCache | None = None,
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """``rope`` holds the RoPE tables of the tokens' positions; ``cache`` and
        ``document_ids`` are :meth:`OctLM.forward`'s."""
        x = x + self.attention(self.attention_norm(x), rope, cache, document_ids)  # (B, T, C)
        return x + self.mlp(self.mlp_norm(x))  # (B, T, C)


class OctLM(nn.Module):
    """The language model. ``model(tokens)`` returns next-token logits at every position.

    The LM head is the token embedding matrix (tied, as in GPT-2): fewer parameters, and at
    this size tying trains no worse. Logits are ``x @ embedding.T``, so the state dict holds
    the matrix once. With ``tied_head=False`` they go through a matrix of their own, ``head``.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        config = replace(config)  # a copy: changing the caller's config cannot change the model
        self.config = config
        self.embedding = nn.Embedding(config.vocab_size, config.width)
        self.blocks = nn.ModuleList(Block(config, layer) for layer in range(config.n_layers))
        self.norm = nn.RMSNorm(config.width, eps=config.norm_eps)
        if not config.tied_head:
            self.head = nn.Linear(config.width, config.vocab_size, bias=False)
        cos, sin = rope_tables(config)
        self.register_buffer("cos", cos, persistent=False)  # (max_length, D)
        self.register_buffer("sin", sin, persistent=False)  # (max_length, D)
        self.apply(self._init_weights)
        # GPT-2: scale the projections that write into the residual stream by depth.
        for name, parameter in self.named_parameters():
            if name.endswith(("attention.output.weight", "mlp.down.weight")):
                nn.init.normal_(parameter, std=0.02 / math.sqrt(2 * config.n_layers))

    def get_extra_state(self) -> dict:
        """The config rides in the state dict (as ``_extra_state``), so that weights can be
        checked against the model they are loaded into."""
        return {"config": asdict(self.config)}

    def set_extra_state(self, state: dict) -> None:
        """Refuse weights saved from another config; ``load_state_dict`` calls this before it
        copies any tensor, so a refused load leaves the model as it was."""
        differences = differing_fields(saved_config(state), self.config)
        if differences:
            raise ValueError(
                f"these weights come from a model of another config ({'; '.join(differences)}, "
                "saved vs this model); build the model from the saved config, as OctLM.load does"
            )

    def save(self, path: str | os.PathLike) -> None:
        """Write the weights, the config and a checksum to ``path``, atomically: a crash
        leaves the old file or the new one (:func:`octlm.files.write_model`)."""
        write_model(path, self.state_dict())

    @classmethod
    def load(
        cls, path: str | os.PathLike, *, map_location: str | torch.device = "cpu", **changes
    ) -> OctLM:
        """The model :meth:`save` wrote to ``path``, built from the saved config.

        ``changes`` may set how it runs (``attention``, ``block``, ``kernel``, ``dropout``);
        any other field that differs from the saved one is refused with a ``ValueError``, as is
        a file that is torn, corrupted or not an octlm model.
        """
        unknown = sorted(set(changes) - {field.name for field in fields(ModelConfig)})
        if unknown:
            raise TypeError(f"OctLM.load got fields that ModelConfig does not have: {unknown}")
        state = read_model(path, map_location)
        model = cls(replace(saved_config(state.get("_extra_state")), **changes))
        model.to(state["embedding.weight"].dtype)  # the dtype it was saved in, not the default
        model.load_state_dict(state)
        return model

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, **changes) -> OctLM:
        """The model of a local transformers folder of the Llama family (``LlamaForCausalLM``,
        ``MistralForCausalLM``, ``Qwen3ForCausalLM``), in the dtype of its weights.

        ``changes`` may set how it runs (``attention``, ``block``, ``kernel``, ``dropout``).
        What octlm cannot compute exactly (biases, another activation or head size, RoPE
        scaling) is a ``ValueError`` naming the field; docs/transformers.md says what maps to
        what.
        """
        from octlm.integrations import llama_format  # safetensors, only when it is needed

        unknown = sorted(set(changes) - INTERCHANGEABLE)
        if unknown:
            raise TypeError(
                f"OctLM.from_pretrained takes the model's config from the folder and may change "
                f"only {sorted(INTERCHANGEABLE)}, got {unknown}"
            )
        config = ModelConfig(**llama_format.read_config(folder), **changes)
        state = llama_format.read_weights(folder, config)
        model = cls(config)
        model.to(state["embedding.weight"].dtype)
        model.load_state_dict({**state, "_extra_state": model.get_extra_state()})
        return model

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(
        self,
        tokens: Tensor,
        document_ids: Tensor | None = None,
        cache: KVCache | None = None,
        positions: Tensor | None = None,
    ) -> Tensor:
        """Logits ``(B, T, V)`` for int64 ``tokens (B, T)``.

        ``document_ids`` (int ``(B, T)``) packs several documents into a row: a token attends only
        to the tokens of its own document, and its RoPE position is its place within that document,
        so each document gets the logits it would get alone (docs/design.md, 'Tensor conventions').
        With ``cache``, the tokens continue the cached sequence: their keys and values are
        appended and they attend to everything before them. ``positions`` (int64 ``(T,)``)
        gives the tokens' absolute positions for RoPE; by default they follow the cache,
        ``past + arange(T)``. Documents take neither a cache nor ``positions``.
        """
        self._check_tokens(tokens)
        if cache is not None and not isinstance(cache, KVCache):
            raise TypeError(f"cache must be a KVCache or None, got {type(cache).__name__}")
        if document_ids is not None:
            self._check_documents(tokens, document_ids, cache, positions)
        past = 0 if cache is None else cache.length
        positions = self._positions(tokens, past, positions)  # (T,), length checked
        if document_ids is not None:
            positions = document_positions(document_ids)  # (B, T), each document from 0
        if cache is not None:  # every check before the first layer writes into the cache
            weight = self.embedding.weight
            cache.prepare(self.config, tokens, weight.dtype, weight.device)
        # (1, T, D) or (B, 1, T, D), broadcast over heads
        rope = (self.cos[positions].unsqueeze(-3), self.sin[positions].unsqueeze(-3))
        x = self.embedding(tokens)  # (B, T, C)
        for block in self.blocks:
            x = block(x, rope, cache, document_ids)  # (B, T, C)
        head = self.embedding if self.config.tied_head else self.head
        logits = F.linear(self.norm(x), head.weight)  # (B, T, V)
        if cache is not None:  # only a call that produced its logits is counted
            cache.advance(tokens.shape[1])
        return logits

    def _check_documents(
        self,
        tokens: Tensor,
        document_ids: Tensor,
        cache: KVCache | None,
        positions: Tensor | None,
    ) -> None:
        """Refuse, before anything runs, ``document_ids`` that this call cannot use."""
        if not isinstance(document_ids, Tensor):
            raise TypeError(
                f"document_ids must be a torch.Tensor or None, got {type(document_ids).__name__}"
            )
        if (
            document_ids.is_floating_point()
            or document_ids.is_complex()
            or document_ids.dtype == torch.bool
        ):
            raise TypeError(f"document_ids must be an integer tensor, got {document_ids.dtype}")
        if document_ids.shape != tokens.shape:
            raise ValueError(
                f"document_ids must have the shape of tokens {tuple(tokens.shape)}, "
                f"got {tuple(document_ids.shape)}"
            )
        if document_ids.device != tokens.device:
            raise ValueError(
                f"document_ids is on {document_ids.device} but tokens are on {tokens.device}"
            )
        if cache is not None:
            raise ValueError(
                "document_ids cannot be combined with a KVCache: decoding packed rows is not "
                "supported; decode each document in its own row"
            )
        if positions is not None:
            raise ValueError(
                "document_ids set the RoPE positions (each document counts from 0): "
                "pass positions or document_ids, not both"
            )
        name = self.config.attention
        if name not in taking("document_ids"):
            raise ValueError(
                f"document_ids need attention in {taking('document_ids')}; {name!r} does not "
                "take them"
            )

    def _check_tokens(self, tokens: Tensor) -> None:
        if not isinstance(tokens, Tensor) or tokens.dtype != torch.int64:
            got = tokens.dtype if isinstance(tokens, Tensor) else type(tokens).__name__
            raise TypeError(f"tokens must be an int64 tensor, got {got}")
        if tokens.dim() != 2 or tokens.numel() == 0:
            raise ValueError(
                f"tokens must have shape (batch, length) with batch >= 1 and length >= 1, "
                f"got {tuple(tokens.shape)}"
            )
        if torch.compiler.is_compiling():
            # Reading values back would break the compiled graph in two; the values of a
            # training batch come from the token files, whose ids the tokenizer made.
            return
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.config.vocab_size:
            raise ValueError(
                f"tokens must lie in [0, vocab_size={self.config.vocab_size}), "
                f"got values in [{low}, {high}]"
            )

    def _positions(self, tokens: Tensor, past: int, positions: Tensor | None) -> Tensor:
        """The tokens' absolute positions ``(T,)``, checked against ``max_length``."""
        length, max_length = tokens.shape[1], self.config.max_length
        if positions is None:
            if past + length > max_length:
                raise ValueError(
                    f"sequence of {past + length} positions ({past} cached + {length} new) "
                    f"exceeds max_length={max_length}"
                )
            return torch.arange(past, past + length, device=tokens.device)
        if not isinstance(positions, Tensor) or positions.dtype != torch.int64:
            raise TypeError("positions must be an int64 tensor of shape (length,)")
        if positions.shape != (length,):
            raise ValueError(
                f"positions must have shape (length,) = ({length},), got {tuple(positions.shape)}"
            )
        if int(positions.min()) < 0 or int(positions.max()) >= max_length:
            raise ValueError(
                f"positions must lie in [0, max_length={max_length}), got values in "
                f"[{int(positions.min())}, {int(positions.max())}]"
            )
        return positions.to(tokens.device)

    @torch.no_grad()
    def generate(
        self,
        prompt: Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
        end_token: int | None = None,
    ) -> Tensor:
        """Continue ``prompt (B, T)`` by up to ``max_new_tokens``; returns ``(B, T + n)``.

        The prompt is prefilled in one call, then one token per call through a KV cache.
        ``temperature == 0`` is greedy; otherwise logits are divided by ``temperature``,
        limited to the ``top_k`` largest if given, and sampled with ``generator``. Dropout
        follows the module's mode: call ``model.eval()`` first for deterministic decoding.
        With ``end_token`` (a tokenizer's end of text), a row that draws it has ended: it
        draws nothing more (its later places repeat ``end_token``), and generation stops once
        every row has ended, so ``n`` may be less than ``max_new_tokens``.
        """
        if not is_int_at_least(max_new_tokens, 0):
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        if not temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {temperature!r}")
        if top_k is not None and not is_int_at_least(top_k, 1):
            raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
        self._check_tokens(prompt)
        if end_token is not None and not (
            is_int_at_least(end_token, 0) and end_token < self.config.vocab_size
        ):
            raise ValueError(
                f"end_token must be None or a token id in [0, {self.config.vocab_size}), got "
                f"{end_token!r}"
            )
        total = prompt.shape[1] + max_new_tokens
        if total > self.config.max_length:
            raise ValueError(
                f"prompt of {prompt.shape[1]} plus max_new_tokens={max_new_tokens} makes "
                f"{total} positions, more than max_length={self.config.max_length}"
            )
        cache = KVCache(self.config, capacity=total)
        tokens = [prompt]
        ended = torch.zeros(prompt.shape[0], 1, dtype=torch.bool, device=prompt.device)  # (B, 1)
        logits = self(prompt, cache=cache)[:, -1]  # (B, V)
        for step in range(max_new_tokens):
            drawn = sample(logits, temperature, top_k, generator)  # (B, 1)
            if end_token is not None:
                drawn = drawn.masked_fill(ended, end_token)  # (B, 1)
                ended = ended | (drawn == end_token)
            tokens.append(drawn)
            if end_token is not None and bool(ended.all()):
                break
            if step + 1 < max_new_tokens:
                logits = self(drawn, cache=cache)[:, -1]  # (B, V)
        return torch.cat(tokens, dim=1)


def document_positions(document_ids: Tensor) -> Tensor:
    """Each token's RoPE position ``(B, T)``: how many tokens of its document precede it.

    For a document in one run of tokens (as packing makes them) that is its index minus the index of
    the document's first token. Ids may also recur apart (docs/design.md, 'Tensor conventions'
    allows it); counting within the document keeps the positions it would have alone (a ``window``
    still counts distance in the row, so with one only documents in one run match).
    """
    length = document_ids.shape[1]
    order = document_ids.argsort(dim=1, stable=True)  # (B, T): each document's tokens, in order
    grouped = document_ids.gather(1, order)  # (B, T)
    index = torch.arange(length, device=document_ids.device).expand_as(order)  # (B, T)
    first = torch.ones_like(grouped, dtype=torch.bool)  # (B, T): a document's first token
    first[:, 1:] = grouped[:, 1:] != grouped[:, :-1]
    start = torch.where(first, index, 0).cummax(dim=1).values  # (B, T)
    return torch.empty_like(order).scatter_(1, order, index - start)  # (B, T)


def saved_config(state: object) -> ModelConfig:
    """The config stored in a state dict's ``_extra_state``; ``ValueError`` if there is none."""
    if not isinstance(state, dict) or not isinstance(state.get("config"), dict):
        raise ValueError(f"the weights carry no octlm model config, got extra state {state!r:.80}")
    try:
        return ModelConfig(**state["config"])
    except TypeError as error:
        raise ValueError(f"the saved model config is not one this octlm reads: {error}") from error


def sample(
    logits: Tensor, temperature: float, top_k: int | None, generator: torch.Generator | None
) -> Tensor:
    """One token ``(B, 1)`` per row of ``logits (B, V)``: argmax, or a tempered draw."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    # Shifted to a largest logit of 0 first, in float64 (a float32 temperature could round to
    # 0): a tiny temperature then sends the others to -inf (greedy, in the limit) instead of
    # overflowing to inf - inf = NaN.
    logits = logits.double()
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature  # (B, V)
    if top_k is not None:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)
