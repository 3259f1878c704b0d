"""``attention="auto"``: per call, the faster exact path of ``sdpa`` and ``tiled``.

:func:`route` holds the whole rule (docs/design.md, 'Which implementation auto runs') and says
what it chose and why; :func:`auto_attention` follows it. Both implementations compute the same
function (docs/design.md, 'When are two results equal'), so the choice changes speed and
memory, never the result beyond rounding, with one exception: a NaN or infinity in a key or
value that a row cannot see leaves the row alone in ``tiled``, while ``sdpa`` may make the row
NaN (docs/design.md, 'Tensor conventions').

The rule rests on one observation: SDPA's fused kernel is the fastest path for a call it takes
without a dense ``(q_len, k_len)`` mask, and tiled's block engine is the fastest wherever the
call's structure hides whole blocks, which a dense mask can only hide one score at a time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import Tensor

from octlm.attention.inputs import Call, call_of, check, keyword_only
from octlm.attention.sdpa import sdpa_call
from octlm.attention.tiled.attention import tiled_call
from octlm.attention.tiled.options import DEFAULT_BLOCK, KERNELS, parse_block

if TYPE_CHECKING:
    from octlm.attention.block_masks import BlockMask


@keyword_only
def route(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    causal: bool = True,
    window: int = 0,
    mask: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    key_lengths: Tensor | None = None,
    key_starts: Tensor | None = None,
    document_ids: Tensor | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    block_mask: BlockMask | None = None,
) -> tuple[str, str]:
    """``(name, reason)``: the implementation ``attention="auto"`` runs for this call, and why.

    Reads only the call's sizes and which keywords are set, never a tensor's values, so it
    costs a few Python operations and no device synchronisation. In order:

    - ``dropout_p > 0``: ``sdpa``, the fast implementation with attention dropout.
    - structure that hides whole blocks or needs a dense score term (``block_mask``,
      ``document_ids``, ``key_lengths``/``key_starts``, a ``window`` narrower than the keys,
      ``softcap``, ``alibi_slopes``, ``sinks``): ``tiled``, which skips the hidden blocks and
      applies the modifiers per tile, where SDPA needs them as a dense mask or bias.
    - an explicit ``mask``: it is dense in every implementation. Beside ``causal`` with more
      than one query row, ``tiled``, which still skips the blocks above the diagonal where
      SDPA, given one dense mask of both, computes every score; otherwise ``sdpa``, whose
      fused kernel applies a dense mask faster than the block loop. A float mask whose rows
      carry finite values beyond ±2¹⁶ with gradients wanted makes ``sdpa`` fall back on its
      MATH backend (docs/design.md, 'Tensor conventions'); this rule cannot see values, so name
      ``tiled`` there.
    - no structure: ``sdpa`` for non-causal calls, causal ones with ``q_len == k_len``
      (SDPA's own ``is_causal``) and a single query row, which sees every key; ``tiled`` for
      other causal shapes (a chunk after a KV cache), whose bottom-right rule SDPA takes
      only as a ``(q_len, k_len)`` mask.

    On CUDA, ``tiled`` itself runs the Triton kernel where it fits (:func:`tiled_attention`).
    Its validation checks no tensor's values either (meta tensors are welcome).
    """
    return route_call(check(call_of(locals()), values=False))


def route_call(call: Call) -> tuple[str, str]:
    """:func:`route` of a checked call."""
    if call.dropout_p > 0:
        return "sdpa", f"sdpa: dropout_p={call.dropout_p:g}, which tiled does not implement"
    skipped = _block_structure(call)
    if skipped:
        return "tiled", "tiled: " + "; ".join(skipped)
    single_row = call.q_len == 1 and call.k_len > 0  # bottom-right causal hides nothing from it
    if call.mask is not None:
        if call.causal and not single_row and call.q_len > 0:
            return "tiled", (
                "tiled: causal beside the explicit mask lets the blocks above the diagonal be "
                "skipped; SDPA would compute every score of one dense mask"
            )
        return "sdpa", "sdpa: the explicit mask is dense either way; SDPA's fused kernel applies it"
    if not call.causal:
        return "sdpa", "sdpa: non-causal, no mask needed"
    if call.q_len == call.k_len:
        return "sdpa", "sdpa: plain causal, no mask needed"
    if single_row:
        return "sdpa", "sdpa: one query row sees every key, no mask needed"
    return "tiled", (
        f"tiled: causal with q_len={call.q_len} != k_len={call.k_len}; SDPA would need a "
        "(q_len, k_len) mask"
    )


def _block_structure(call: Call) -> list[str]:
    """Why tiled's blocks win for this call: one phrase per keyword that hides whole blocks or
    that SDPA could take only densely; empty when there is none."""
    found = []
    if call.block_mask is not None:
        found.append("block_mask's empty blocks are skipped and its full ones run unmasked")
    if call.document_ids is not None:
        found.append("document_ids let the blocks of other documents be skipped")
    padded = [name for name in ("key_lengths", "key_starts") if getattr(call, name) is not None]
    if padded:
        found.append(f"padding ({', '.join(padded)}) lets padded blocks be skipped")
    if 0 < call.window < call.k_len:  # a window as wide as the keys hides nothing
        found.append(f"window={call.window} lets whole blocks be skipped")
    if call.softcap is not None:
        found.append("softcap is applied per tile, where SDPA needs the capped scores densely")
    if call.alibi_slopes is not None:
        found.append("alibi_slopes are added per tile, where SDPA needs a dense bias")
    if call.sinks is not None:
        found.append("sinks join each row per tile, where SDPA needs a dense mask and a key")
    return found


@keyword_only
def auto_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    causal: bool = True,
    window: int = 0,
    mask: Tensor | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    key_lengths: Tensor | None = None,
    key_starts: Tensor | None = None,
    document_ids: Tensor | None = None,
    softcap: float | None = None,
    alibi_slopes: Tensor | None = None,
    sinks: Tensor | None = None,
    block_mask: BlockMask | None = None,
    block: int | tuple[int, int] = DEFAULT_BLOCK,
    kernel: str = "auto",
) -> Tensor:
    """Exact attention by whichever of ``sdpa`` and ``tiled`` :func:`route` names for the call.

    Shapes, keywords and results as :func:`~octlm.attention.tiled_attention`, plus attention
    dropout (through ``sdpa``). ``block`` and ``kernel`` are tiled's, used when the call goes
    there, and checked whichever way it goes.
    """
    call = check(call_of(locals()))
    name, _ = route_call(call)
    if name == "tiled":
        return tiled_call(call, block=block, kernel=kernel)
    parse_block(block)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    return sdpa_call(call)
