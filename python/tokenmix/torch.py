"""A differentiable drop-in for ``torch.nn.functional.scaled_dot_product_attention`` (CPU; fp32,
bf16, fp16),
and ``varlen_attention``, the packed variable-length form of FlashAttention's
``flash_attn_varlen_func``.

``tokenmix.torch.scaled_dot_product_attention`` has PyTorch's signature, layout and semantics::

    query [..., H_q, L, E]   key [..., H_kv, S, E]   value [..., H_kv, S, E]  →  [..., H_q, L, E]

    out = softmax(scale · Q Kᵀ + M) V       (SPEC 4.2–4.5; scale defaults to 1/sqrt(E))

computed by tokenmix's fused flash kernels, forward and backward: the registered operators
``torch.ops.tokenmix.attention_forward`` / ``attention_backward`` (module ``_torch_ops``; the
forward saves ``out`` and the row log-sum-exp L, no T×T matrix is stored), so the drop-in works
under ``torch.compile(fullgraph=True)``, ``torch.export``, ``torch.func.grad`` and ``vmap``.
Tensors are passed to the kernels as strided views, without copies: PyTorch's ``[B, H, T, E]``
layout, transposed views of ``[B, T, H, E]`` projections and other non-contiguous inputs all
work in place.

``attn_mask`` has PyTorch's meaning: a bool mask (True = may attend) or a float32 additive bias,
broadcastable to [..., H_q, L, S]; size-1 (and expanded, stride-0) axes are broadcast by the
kernels without a copy (only with more than one batch dimension may the batch axes be merged by
a copy). As in PyTorch, ``attn_mask`` and ``is_causal=True`` together are an error (bake the
causal mask into ``attn_mask``). One difference: a row whose keys are all masked gives zeros
here, NaN in PyTorch. A float mask gets no gradient: one with ``requires_grad`` raises
``tokenmix.UnsupportedError`` (never a silently missing gradient).

Alignment of the causal mask: like PyTorch, ``is_causal=True`` here is ``"top_left"`` aligned
when L ≠ S (query i sees keys j ≤ i). The keyword-only ``causal_align="bottom_right"`` puts query
i at position i + S − L (query i sees j ≤ i + S − L: chunked prefill over a KV cache, what
tokenmix's native API defaults to; SPEC 4.3). The two agree when L == S. The alignment also
places the queries for ``window`` and ``alibi_slopes``.

Keyword-only extras beyond PyTorch's signature (SPEC "Score variants used by real models"):
``window`` (sliding window W: the last W positions up to the query's own, Mistral/Gemma),
``softcap`` (c·tanh(z / c), Gemma 2), ``alibi_slopes`` ([H_q] float32 tensor, BLOOM/MPT; no
gradient, so one with ``requires_grad`` raises), ``sinks`` ([H_q] float32 tensor of per-head sink
logits, gpt-oss; ``requires_grad`` is honoured: its gradient comes from tokenmix's backward).

Dtypes (SPEC "Reduced precision"): query, key and value are float32, bfloat16 or float16, all
three alike (mixed dtypes raise tokenmix.UnsupportedError, a NotImplementedError and so the
RuntimeError PyTorch raises); the output and the gradients come in that dtype. Products
accumulate in float32, softmax statistics and L are float32, and O, dQ, dK, dV are rounded to
the dtype once, at the end. Under ``torch.autocast("cpu")`` the inputs are cast as PyTorch's CPU
autocast casts them for its SDPA (a "lower precision" op: floating-point inputs other than
float64 to the autocast dtype, bfloat16 by default; float32 leaves get float32 gradients through
the cast); a float ``attn_mask`` is not cast. ``attn_mask`` may be bool, float32 or the query's
dtype (as in PyTorch; a bfloat16/float16 bias is widened to float32 exactly, a copy of the mask).
``sinks`` and ``alibi_slopes`` are float32 (bfloat16/float16 ones are widened exactly; the
sinks' gradient flows back through the widening).

Supported: float32, bfloat16 and float16 CPU tensors, any number of batch dimensions (equal for
q, k, v), grouped query attention with ``enable_gqa=True`` (H_q a multiple of H_kv; as in
PyTorch, H_q ≠ H_kv without it is an error), ``scale``, ``is_causal``, ``attn_mask``. Everything
else raises ``tokenmix.UnsupportedError`` (a ``NotImplementedError``) naming the argument:
a non-CPU device, a dtype other than float32, bfloat16 and float16, a value
head width different from the query's, batch dimensions that need broadcasting. Double backward
raises ``tokenmix.UnsupportedError``.

Threads: the kernels use ``torch.get_num_threads()`` threads, so ``torch.set_num_threads``
controls both libraries.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch

from . import _tokenmix as _C
from . import _torch_ops as _ops

__all__ = ["scaled_dot_product_attention", "varlen_attention"]

_FN = "tokenmix.torch.scaled_dot_product_attention"
_FN_VARLEN = "tokenmix.torch.varlen_attention"
_ALIGNS = ("top_left", "bottom_right")


def _as_bhtd(x: torch.Tensor) -> torch.Tensor:
    """[..., H, T, E] → [B, H, T, E] (a view whenever the batch dims can be merged)."""
    if x.dim() == 2:
        return x.unsqueeze(0).unsqueeze(0)
    if x.dim() == 3:
        return x.unsqueeze(0)
    if x.dim() == 4:
        return x
    return x.reshape((-1,) + tuple(x.shape[-3:]))


def _unsupported(what: str, fn: str = _FN) -> NotImplementedError:
    """tokenmix.UnsupportedError (a NotImplementedError) naming the entry point."""
    return _typed(_C.UnsupportedError, "unsupported", f"{fn}: {what}")


# The dtypes of q, k, v (and out, the gradients): SPEC "Reduced precision".
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _autocast(tensors: Tuple[torch.Tensor, ...]) -> Tuple[torch.Tensor, ...]:
    """Under ``torch.autocast("cpu")``, what PyTorch's CPU autocast does for
    scaled_dot_product_attention (a "lower precision" op): floating-point inputs other than
    float64 are cast to the autocast dtype (bfloat16 by default, or float16). The cast is an
    autograd op, so float32 leaves get float32 gradients. A float attn_mask is not cast (it
    stays float32, which the kernels take with any q dtype, as PyTorch does)."""
    if not torch.is_autocast_enabled("cpu"):
        return tensors
    dtype = torch.get_autocast_dtype("cpu")
    return tuple(t.to(dtype) if t.is_floating_point() and t.dtype not in (torch.float64, dtype)
                 else t for t in tensors)


def _check_dtypes(fn: str, tensors: Tuple[Tuple[str, torch.Tensor], ...]) -> None:
    """q, k, v in float32, bfloat16 or float16, all in one dtype (as PyTorch requires; the
    error is tokenmix.UnsupportedError, a NotImplementedError and so a RuntimeError, PyTorch's
    type for it)."""
    for name, t in tensors:
        if t.dtype not in _DTYPES:
            raise _typed(_C.UnsupportedError, "unsupported",
                         f"{fn}: {name} has dtype {t.dtype}; only torch.float32, torch.bfloat16 "
                         "and torch.float16 are supported")
    (n0, t0) = tensors[0]
    for name, t in tensors[1:]:
        if t.dtype != t0.dtype:
            raise _typed(_C.UnsupportedError, "unsupported",
                         f"{fn}: {name} has dtype {t.dtype} but {n0} has {t0.dtype}; "
                         f"{', '.join(n for n, _ in tensors)} must have one dtype (as in "
                         "PyTorch; no implicit conversion is made)")


def _typed(kind: Any, code: str, msg: str) -> Exception:
    """A tokenmix.ArgumentError / UnsupportedError raised from Python, with its ``code``."""
    err = kind(msg)
    err.code = code
    return err


def _check_variants(fn: str, H_q: int, window: Any, softcap: Any, alibi_slopes: Any,
                    sinks: Any, causal_align: str) -> Tuple[Any, ...]:
    """Checks the keyword-only extras; returns (window, softcap, alibi_slopes, sinks)."""
    if causal_align not in _ALIGNS:
        raise _typed(_C.ArgumentError, "invalid_argument",
                     f"{fn}: causal_align must be one of top_left, bottom_right; got "
                     f"{causal_align!r}")
    if window is not None:
        if isinstance(window, bool):
            raise TypeError(f"{fn}: window must be an int or None; got bool")
        if not isinstance(window, int):
            try:
                window = int(window.__index__())
            except (AttributeError, TypeError):
                raise TypeError(f"{fn}: window must be an int or None; got "
                                f"{type(window).__name__}") from None
    if softcap is not None:
        if isinstance(softcap, (bool, str)):
            raise TypeError(f"{fn}: softcap must be a real number or None; got "
                            f"{type(softcap).__name__}")
        try:
            softcap = float(softcap)
        except (TypeError, ValueError):
            raise TypeError(f"{fn}: softcap must be a real number or None; got "
                            f"{type(softcap).__name__}") from None
    checked = []
    for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is None:
            checked.append(None)
            continue
        if isinstance(t, (list, tuple)):
            t = torch.tensor(t, dtype=torch.float32)
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor, a list of floats or None; "
                            f"got {type(t).__name__}")
        if t.device.type != "cpu":
            raise _unsupported(f"{name} is on device '{t.device}'; tokenmix runs on the CPU only",
                               fn)
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.float()  # exact; an autograd op, so a bf16 sinks parameter gets its gradient
        if t.dtype != torch.float32:
            raise _unsupported(f"{name} has dtype {t.dtype}; only torch.float32 (or bfloat16 / "
                               "float16, widened exactly) is supported", fn)
        if tuple(t.shape) != (H_q,):
            raise _typed(_C.ArgumentError, "shape_mismatch",
                         f"{fn}: {name} must have shape ({H_q},) (one per query head); got "
                         f"{tuple(t.shape)}")
        if name == "alibi_slopes" and t.requires_grad:
            raise _typed(_C.UnsupportedError, "unsupported",
                         f"{fn}: alibi_slopes requires grad, but tokenmix computes no gradient "
                         "for the ALiBi slopes; pass alibi_slopes.detach()")
        checked.append(t)
    return window, softcap, checked[0], checked[1]


def _mask_view(attn_mask: torch.Tensor, query: torch.Tensor, S: int) -> torch.Tensor:
    """attn_mask as the [B, H_q, L, S]-broadcastable rank-4 tensor the kernels take (PyTorch's
    broadcasting against [..., H_q, L, S]); size-1 axes stay size 1 (stride 0 in the kernels)."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"{_FN}: attn_mask must be a torch.Tensor or None; got "
                        f"{type(attn_mask).__name__}")
    if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise RuntimeError(
            f"{_FN}: attn_mask must be bool or float32, or query's dtype ({query.dtype}), as in "
            f"PyTorch; got {attn_mask.dtype}"
        )
    if attn_mask.device.type != "cpu":
        raise _unsupported(f"attn_mask is on device '{attn_mask.device}'; tokenmix runs on the "
                           "CPU only")
    if attn_mask.requires_grad:
        raise _typed(
            _C.UnsupportedError, "unsupported",
            f"{_FN}: attn_mask requires grad, but tokenmix computes no gradient for a float "
            "mask (it would be silently missing); pass attn_mask.detach(), or use "
            "torch.nn.functional.scaled_dot_product_attention",
        )
    target = tuple(query.shape[:-1]) + (S,)
    if attn_mask.dim() == 0 or attn_mask.dim() > len(target):
        raise RuntimeError(f"{_FN}: attn_mask of shape {tuple(attn_mask.shape)} does not "
                           f"broadcast to {target}")
    try:
        ok = torch.broadcast_shapes(tuple(attn_mask.shape), target) == torch.Size(target)
    except RuntimeError:
        ok = False
    if not ok:
        raise RuntimeError(f"{_FN}: attn_mask of shape {tuple(attn_mask.shape)} does not "
                           f"broadcast to {target} (query's [..., H_q, L] and key's S)")
    if attn_mask.dtype != torch.bool and attn_mask.dtype != torch.float32:
        # A bias in query's bfloat16/float16 dtype: widened to float32 (exact; a copy of the
        # mask), the kernels' bias dtype for every q dtype.
        attn_mask = attn_mask.float()
    m = attn_mask[(None,) * (len(target) - attn_mask.dim())] if attn_mask.dim() < len(target) \
        else attn_mask
    # m has query's rank; bring it to rank 4 as _as_bhtd does for the query.
    if m.dim() == 2:
        return m[None, None]
    if m.dim() == 3:
        return m[None]
    if m.dim() == 4:
        return m
    # More than one batch dimension: expand the batch axes only and merge them (a copy only when
    # they cannot be merged as a view).
    batch = tuple(query.shape[:-3])
    return m.expand(batch + tuple(m.shape[-3:])).reshape((-1,) + tuple(m.shape[-3:]))


def _fast_shapes(q: Any, k: Any, v: Any, enable_gqa: bool) -> bool:
    """True when q, k, v are plain strided CPU tensors [B, H, T, E] of one dtype (float32,
    bfloat16 or float16) that the general path would accept as they are (same B and E, K and V
    alike, GQA only with enable_gqa), and autocast is off (it may cast them)."""
    if not (type(q) is torch.Tensor and type(k) is torch.Tensor and type(v) is torch.Tensor):
        return False
    if q.dtype not in _DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if torch.is_autocast_enabled("cpu"):
        return False
    qs, ks, vs = q.shape, k.shape, v.shape
    if len(qs) != 4 or len(ks) != 4 or ks != vs or qs[0] != ks[0] or qs[3] != ks[3]:
        return False
    if qs[1] != ks[1] and not (enable_gqa is True and ks[1] > 0 and qs[1] % ks[1] == 0):
        return False
    return (q.is_cpu and k.is_cpu and v.is_cpu and q.layout == torch.strided
            and k.layout == torch.strided and v.layout == torch.strided)


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
    *,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    causal_align: str = "top_left",
) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on CPU float32,
    bfloat16 and float16 (also under ``torch.autocast("cpu")``; module docstring).

    Args:
        query: [..., H_q, L, E] float32, bfloat16 or float16 CPU tensor (any strides).
        key: [..., H_kv, S, E].
        value: [..., H_kv, S, E] (value head width must equal E).
        attn_mask: None, or a bool (True = may attend) or float32 (added to the scores) tensor
            broadcastable to [..., H_q, L, S], as in PyTorch; not together with ``is_causal``
            (RuntimeError, as in PyTorch). No gradient: one with requires_grad raises
            tokenmix.UnsupportedError.
        dropout_p: attention dropout in [0, 1) (docs/design.md D.1–D.4), applied whenever it
            is > 0, as PyTorch's SDPA does (pass 0.0 outside training). The mask is drawn by
            Philox4x32-10 from a seed and offset taken from PyTorch's default CPU generator, so
            ``torch.manual_seed`` repeats it; the backward regenerates it. It is not PyTorch's
            mask (PyTorch's CPU kernels draw theirs from the generator element by element).
        is_causal: causal mask, ``"top_left"`` aligned as in PyTorch (query i sees keys j ≤ i;
            SPEC 4.3); tokenmix's native default is ``"bottom_right"``.
        scale: s of SPEC (4.2); ``None`` = 1/sqrt(E).
        enable_gqa: allow H_q ≠ H_kv (H_q a multiple of H_kv; query head h reads KV head
            h // (H_q // H_kv), SPEC 4.8), as in PyTorch.
        window: sliding window W ≥ 1 (key j visible to query i only if p(i) − W < j, p(i) the
            query's position under ``causal_align``; SPEC "Score variants").
        softcap: c > 0: scores c·tanh(z / c) after the scale.
        alibi_slopes: [H_q] float32 tensor (or list): bias −m_h·(p(i) − j). No gradient.
        sinks: [H_q] float32 tensor (or list) of sink logits; differentiable.
        causal_align: ``"top_left"`` (default, PyTorch's ``is_causal``) or ``"bottom_right"``
            (query i at position i + S − L: chunked prefill on a KV cache).

    Returns:
        [..., H_q, L, E] in query's dtype, differentiable w.r.t. query, key, value and sinks.

    Raises:
        NotImplementedError: for anything this drop-in does not implement (names the argument).
        RuntimeError: for inputs PyTorch rejects too (mismatched sizes, GQA without enable_gqa).
    """
    if (attn_mask is None and not dropout_p and window is None and softcap is None
            and alibi_slopes is None and sinks is None and causal_align == "top_left"
            and type(is_causal) is bool and (scale is None or type(scale) is float)):
        # Fast path for the common call (generation makes thousands per second): plain
        # float32/bf16/f16 CPU [B, H, T, E] tensors whose shapes need no message beyond the
        # library's own (not under autocast).
        fast = _fast_shapes(query, key, value, enable_gqa)
        if fast and (scale is None or math.isfinite(scale)):
            return _ops.attention(query, key, value, None, None, None, scale, is_causal, False,
                                  None, None)
    tensors = (("query", query), ("key", key), ("value", value))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_FN}: {name} must be a torch.Tensor; got {type(t).__name__}")
    if attn_mask is not None and bool(is_causal):
        raise RuntimeError(
            f"{_FN}: explicit attn_mask should not be set when is_causal=True (as in PyTorch); "
            "bake the causal mask into attn_mask"
        )
    dropout_p = _check_dropout(_FN, dropout_p)
    query, key, value = _autocast((query, key, value))
    tensors = (("query", query), ("key", key), ("value", value))
    _check_dtypes(_FN, tensors)
    for name, t in tensors:
        if t.device.type != "cpu":
            raise _unsupported(f"{name} is on device '{t.device}'; tokenmix runs on the CPU only")
        if t.layout != torch.strided:
            raise _unsupported(f"{name} has layout {t.layout}; only strided tensors are supported")
        if t.dim() < 2:
            raise RuntimeError(f"{_FN}: {name} must have at least 2 dimensions; got {t.dim()}")
    if isinstance(is_causal, torch.Tensor):
        is_causal = bool(is_causal)
    if scale is not None:
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"{_FN}: scale must be finite; got {scale}")

    E = query.shape[-1]
    if key.shape[-1] != E:
        raise RuntimeError(
            f"{_FN}: key's last dimension ({key.shape[-1]}) must equal query's ({E})"
        )
    if value.shape[-1] != E:
        raise _unsupported(
            f"value has head width {value.shape[-1]} but query/key have {E}; a different value "
            "width (Ev != E) is not supported"
        )
    if key.shape[-2] != value.shape[-2]:
        raise RuntimeError(
            f"{_FN}: key and value must have the same sequence length; got {key.shape[-2]} "
            f"and {value.shape[-2]}"
        )
    if query.dim() != key.dim() or key.dim() != value.dim() or \
            query.shape[:-3] != key.shape[:-3] or key.shape[:-3] != value.shape[:-3]:
        raise _unsupported(
            "query, key and value must have the same batch dimensions (no broadcasting); got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    H_q = query.shape[-3] if query.dim() >= 3 else 1
    H_kv = key.shape[-3] if key.dim() >= 3 else 1
    if (value.shape[-3] if value.dim() >= 3 else 1) != H_kv:
        raise RuntimeError(f"{_FN}: key and value must have the same number of heads")
    if H_q != H_kv:
        if not enable_gqa:
            raise RuntimeError(
                f"{_FN}: query has {H_q} heads and key/value {H_kv}; pass enable_gqa=True for "
                "grouped-query attention (as with PyTorch)"
            )
        if H_kv == 0 or H_q % H_kv != 0:
            raise RuntimeError(
                f"{_FN}: the number of query heads ({H_q}) must be a multiple of the number of "
                f"key/value heads ({H_kv})"
            )
    window, softcap, alibi_slopes, sinks = _check_variants(
        _FN, H_q, window, softcap, alibi_slopes, sinks, causal_align)
    mask = None if attn_mask is None else _mask_view(attn_mask, query, key.shape[-2])
    # Dropout: a seed and offset from PyTorch's CPU generator per call (torch.manual_seed
    # repeats the masks), kept by autograd for the backward, which regenerates the mask.
    seed = _ops.dropout_seed() if dropout_p else None
    out = _ops.attention(_as_bhtd(query), _as_bhtd(key), _as_bhtd(value), mask, alibi_slopes,
                         sinks, scale, bool(is_causal), causal_align == "bottom_right", window,
                         softcap, dropout_p, seed)
    return out.view(query.shape[:-1] + (E,))


def _check_dropout(fn: str, dropout_p: Any) -> float:
    """dropout_p as a float in [0, 1) (tokenmix.ArgumentError otherwise, a ValueError)."""
    if isinstance(dropout_p, torch.Tensor):
        dropout_p = float(dropout_p)
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)):
        raise TypeError(f"{fn}: dropout_p must be a float; got {type(dropout_p).__name__}")
    p = float(dropout_p)
    if not (0.0 <= p < 1.0):
        raise _typed(_C.ArgumentError, "invalid_argument",
                     f"{fn}: dropout_p must be in [0, 1) (the probability of dropping a "
                     f"weight); got {dropout_p}")
    return p


def _max_seqlen(fn: str, name: str, cu: torch.Tensor, given: Any) -> None:
    """max_seqlen must bound the longest sequence (FlashAttention sizes its grid with it; a
    smaller value there gives wrong results, here an error). Offsets that are not
    non-decreasing are left to the library, which names the index."""
    try:
        given = int(given.__index__())
    except (AttributeError, TypeError):
        raise TypeError(f"{fn}: max_seqlen_{name} must be an int; got "
                        f"{type(given).__name__}") from None
    if cu.dim() != 1 or cu.numel() < 2 or not _ops.plain_eager(cu):
        return  # (traced: the library checks the offsets when the operator runs)
    lengths = cu[1:].to(torch.int64) - cu[:-1].to(torch.int64)
    if bool((lengths >= 0).all()):
        longest = int(lengths.max())
        if longest > given:
            raise _typed(_C.ArgumentError, "invalid_argument",
                         f"{fn}: max_seqlen_{name} is {given} but sequence "
                         f"{int(lengths.argmax())} has {longest} tokens (cu_seqlens_{name})")


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    is_causal: bool = True,
    scale: Optional[float] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Optional[torch.Tensor] = None,
    sinks: Optional[torch.Tensor] = None,
    causal_align: str = "bottom_right",
    dropout_p: float = 0.0,
) -> torch.Tensor:
    """Attention over sequences packed along the token axis, like FlashAttention's
    ``flash_attn_varlen_func`` (SPEC "Score variants": varlen); differentiable.

    Args:
        q: [total_q, H_q, d_h] float32, bfloat16 or float16 CPU tensor (autocast as for
            :func:`scaled_dot_product_attention`); k, v: [total_k, H_kv, d_h] in q's dtype (H_q
            a multiple of H_kv: GQA, SPEC 4.8).
        cu_seqlens_q, cu_seqlens_k: [n + 1] int32/int64 CPU tensors: sequence i owns query rows
            [cu_q[i], cu_q[i+1]) and keys [cu_k[i], cu_k[i+1]); 0 first, non-decreasing, ending
            at total_q / total_k (tokenmix.ArgumentError naming the index otherwise).
        max_seqlen_q, max_seqlen_k: the longest sequence (FlashAttention's grid size); a value
            below the real longest raises tokenmix.ArgumentError.
        is_causal: causal mask within each sequence, ``causal_align`` aligned — by default
            ``"bottom_right"`` (FlashAttention ≥ 2.1: query i of a sequence with L queries and S
            keys sees keys j ≤ i + S − L).
        scale, window, softcap, alibi_slopes, sinks, dropout_p: as for
            :func:`scaled_dot_product_attention`; positions are per sequence (dropout: sequence
            i draws its mask as batch row i).

    Returns:
        [total_q, H_q, d_h] in q's dtype, differentiable w.r.t. q, k, v and sinks.
    """
    fn = _FN_VARLEN
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor; got {type(t).__name__}")
    q, k, v = _autocast((q, k, v))
    _check_dtypes(fn, (("q", q), ("k", k), ("v", v)))
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.device.type != "cpu":
            raise _unsupported(f"{name} is on device '{t.device}'; tokenmix runs on the CPU only",
                               fn)
        if t.dim() != 3:
            raise _typed(_C.ArgumentError, "shape_mismatch",
                         f"{fn}: {name} must have 3 dimensions [total, H, d_h]; got shape "
                         f"{tuple(t.shape)}")
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a torch.Tensor (int32 or int64); got "
                            f"{type(t).__name__}")
        if t.device.type != "cpu":
            raise _unsupported(f"{name} is on device '{t.device}'; tokenmix runs on the CPU only",
                               fn)
    if isinstance(is_causal, torch.Tensor):
        is_causal = bool(is_causal)
    if scale is not None:
        scale = float(scale)
        if not math.isfinite(scale):
            raise _typed(_C.ArgumentError, "invalid_argument",
                         f"{fn}: scale must be finite; got {scale}")
    _max_seqlen(fn, "q", cu_seqlens_q, max_seqlen_q)
    _max_seqlen(fn, "k", cu_seqlens_k, max_seqlen_k)
    dropout_p = _check_dropout(fn, dropout_p)
    window, softcap, alibi_slopes, sinks = _check_variants(
        fn, q.shape[1], window, softcap, alibi_slopes, sinks, causal_align)
    return _ops.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, scale,
                       bool(is_causal), causal_align == "bottom_right", window, softcap,
                       dropout_p, _ops.dropout_seed() if dropout_p else None)
