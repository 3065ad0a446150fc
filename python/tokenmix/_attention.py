"""Attention forward and backward over NumPy arrays and PyTorch tensors (SPEC 4.2–4.5,
"Backward pass"), with the score variants and the varlen form of SPEC "Score variants used by real
models", and the useful-work counts of SPEC "Useful-work counts".

Score variants (keyword arguments of every entry point; None = off; any combination, with the
causal mask and both alignments). With p(t) the position of query t (t + T_k − T_q bottom-right,
t top-left) and z = s·⟨q_t, k_u⟩ (4.2), the score is S = cap(z) + b_h(t, u) + bias::

    window=W        key u visible to row t only if p(t) − W < u (the last W positions up to
                    p(t); FlashAttention's window_size = (W − 1, 0))
    softcap=c       cap(z) = c·tanh(z / c) (Gemma 2)
    alibi_slopes=m  [H_q] float32: b_h(t, u) = −m_h·(p(t) − u) (BLOOM, MPT)
    sinks=σ         [H_q] float32: a logit per query head in every row's softmax denominator, with
                    no value (gpt-oss); L includes it; the backward returns d(sinks)
    mask=M          bool (True = may attend) or float32 (additive bias; −inf excludes), any rank
                    ≤ 4 broadcastable to [B, H_q, T_q, T_k] (always this order, also with
                    layout="bhtd"); size-1 and stride-0 axes broadcast without a copy
    key_lengths=n   [B] int32/int64: keys u ≥ n[b] of sequence b are padding (invisible)

A row that sees no key gives O = 0 and L = −inf (with sinks: L = σ_h), never NaN.

Attention dropout (training; docs/design.md "Attention dropout", D.1–D.4), keyword arguments of
the forward, backward, weights and varlen entry points::

    dropout_p=p         0 ≤ p < 1: the values are averaged with P̃ = P ⊙ Z / (1 − p), Z_{b,h,t,u}
                        kept with probability 1 − p; lse stays that of P (0 = off)
    dropout_seed=s      any int64: Philox4x32-10's key
    dropout_offset=o    0 ≤ o < 2^32: the counter's last word (a new one per step, or a new seed)

Z depends on (seed, offset, b, h, t, u) alone: the same on every path and thread count, and the
backward regenerates it (given the same three values). :func:`attention_dropout_mask` returns it.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import _tokenmix as _C
from ._convert import (
    as_array, as_output, check_layout, index_vector, new_empty, opt_float, opt_mask4, opt_vector,
    view4,
)


def attention_forward(
    q: Any,
    k: Any,
    v: Any,
    out: Any = None,
    lse: Any = None,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    align: str = "bottom_right",
    layout: str = "bthd",
    threads: int = 0,
    isa: str = "auto",
    return_lse: bool = False,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
    mask: Any = None,
    key_lengths: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    dropout_offset: int = 0,
) -> Any:
    """Exact scaled-dot-product attention, forward (SPEC 4.2–4.5).

    Per query head h with KV head j = h // (H_q // H_kv) (4.8)::

        S = s · Q_h K_jᵀ            (4.2)   s = scale, default 1/sqrt(d_h)
        A = softmax(S + M)          (4.3, 4.4)   M: causal mask if causal
        O_h = A V_j                 (4.5)   L_t = log Σ_u exp(S_tu + M_tu)

    Args:
        q: [B, T_q, H_q, d_h] float32, bfloat16 (``ml_dtypes.bfloat16`` / ``torch.bfloat16``)
            or float16 (``layout="bhtd"``: [B, H_q, T_q, d_h]); any strides.
        k, v: [B, T_k, H_kv, d_h] in q's dtype (or [B, H_kv, T_k, d_h]).
        out: optional output in q's layout, shape and dtype, written in place (allocated in
            q's dtype when not given; SPEC "Reduced precision": products accumulate in float32,
            O is rounded to the dtype once).
        lse: optional row log-sum-exp output [B, H_q, T_q], float32 for every dtype.
        scale: s of (4.2); ``None`` = 1/sqrt(d_h).
        causal: apply the causal mask M (4.3).
        align: ``"bottom_right"`` (default: query t is at absolute position t + T_k − T_q, as
            KV-cache decoding needs) or ``"top_left"`` (query t sees keys u ≤ t, PyTorch's
            ``is_causal``) — the library's one spelling (the CLI's ``--align`` too); another
            value raises ArgumentError (a ValueError, code ``"invalid_argument"``). Identical
            when T_q == T_k. A query that sees no key gets O = 0, L = −inf.
        layout: ``"bthd"`` or ``"bhtd"`` — the memory order of q, k, v and out.
        threads: worker threads, 0 = all; results do not depend on it.
        isa: ``"auto"``, ``"portable"``, ``"avx2"``, ``"avx512"`` or ``"neon"`` (force a kernel
            path).
        return_lse: allocate and return lse as well.
        window, softcap, alibi_slopes, sinks, mask, key_lengths: the score variants (module
            docstring; SPEC "Score variants used by real models"); None = off. alibi_slopes and
            sinks may be lists of floats, key_lengths a list of ints.
        dropout_p, dropout_seed, dropout_offset: attention dropout (module docstring); 0 = off.

    Returns:
        ``out``, or ``(out, lse)`` when lse was given or ``return_lse`` is set.
    """
    fn = "attention_forward"
    check_layout(fn, layout)
    q, k, v = as_array(fn, "q", q), as_array(fn, "k", k), as_array(fn, "v", v)
    q4, k4, v4 = view4(fn, "q", q, layout), view4(fn, "k", k, layout), view4(fn, "v", v, layout)
    B, T_q, H_q, _ = q4.shape
    out = new_empty(q, tuple(q.shape)) if out is None else as_output(fn, "out", out)
    if lse is None and return_lse:
        lse = new_empty(q, (B, H_q, T_q), float32=True)
    elif lse is not None:
        lse = as_output(fn, "lse", lse)
    _C.attention_forward(
        q4, k4, v4, view4(fn, "out", out, layout), lse, scale, causal, align, threads, isa,
        **_variants(fn, window, softcap, alibi_slopes, sinks, mask, key_lengths),
        dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
    )
    return (out, lse) if lse is not None else out


def attention_weights(
    q: Any,
    k: Any,
    lse: Any,
    weights: Any = None,
    *,
    heads: Any = None,
    rows: Any = None,
    scale: Optional[float] = None,
    causal: bool = True,
    align: str = "bottom_right",
    layout: str = "bthd",
    threads: int = 0,
    isa: str = "auto",
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
    mask: Any = None,
    key_lengths: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    dropout_offset: int = 0,
) -> Any:
    """The attention weights of the forward, on request (SPEC 4.2–4.4)::

        P[b, i, t, u] = exp(S_tu + M_tu − L_t)     for head heads[i], row t of rows

    exactly the A = softmax(S + M) the forward used, from q, k and its saved ``lse`` (no T×T
    buffer beyond the output). Masked keys (causal, window, key lengths, boolean mask, a −inf
    bias) are exactly 0; with sinks a row sums to 1 − e^(σ_h − L_t).

    Args:
        q: [B, T_q, H_q, d_h] (``layout="bhtd"``: [B, H_q, T_q, d_h]) float32, bfloat16 or
            float16; k: [B, T_k, H_kv, d_h] in q's dtype and layout.
        lse: [B, H_q, T_q] float32 from the forward (``return_lse=True``).
        weights: optional float32 output [B, len(heads), len(rows), T_k] (any strides), written
            in place; allocated (NumPy or torch, as q) when not given.
        heads: query heads in output order (a list of ints, repeats allowed); None = all.
        rows: query rows, ``None`` (all), a ``slice``/``range`` with step 1 or a
            ``(begin, end)`` pair: rows begin … end − 1.
        scale, causal, align, threads, isa, window, softcap, alibi_slopes, sinks, mask,
            key_lengths: the forward's (they must be the same, or P is of another function).

    Returns:
        ``weights`` (float32, [B, heads, rows, T_k]).
    """
    fn = "attention_weights"
    check_layout(fn, layout)
    q, k, lse = as_array(fn, "q", q), as_array(fn, "k", k), as_array(fn, "lse", lse)
    q4, k4 = view4(fn, "q", q, layout), view4(fn, "k", k, layout)
    B, T_q, H_q, _ = q4.shape
    head_list = None if heads is None else _head_list(fn, heads)
    begin, end = _row_range(fn, rows, T_q)
    if weights is None:
        n_heads = H_q if head_list is None else len(head_list)
        weights = new_empty(q, (B, n_heads, max(end - begin, 0), k4.shape[1]), float32=True)
    else:
        weights = as_output(fn, "weights", weights)
    _C.attention_weights(
        q4, k4, lse, weights, head_list, begin, None if end == T_q else end, scale, causal, align,
        threads, isa, **_variants(fn, window, softcap, alibi_slopes, sinks, mask, key_lengths),
        dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
    )
    return weights


def _head_list(fn: str, heads: Any) -> list:
    """heads as a list of Python ints (a list/tuple/range of ints, a 1-D integer array or an int)."""
    if isinstance(heads, (int, np.integer)) and not isinstance(heads, (bool, np.bool_)):
        return [int(heads)]
    out = []
    for h in (heads.tolist() if hasattr(heads, "tolist") else heads):
        if isinstance(h, (bool, np.bool_)) or not isinstance(h, (int, np.integer)):
            raise TypeError(f"{fn}: heads must be integers (query head indices); got "
                            f"{type(h).__name__}")
        out.append(int(h))
    return out


def _row_range(fn: str, rows: Any, T_q: int) -> Tuple[int, int]:
    """(begin, end) of rows: None (all), a slice or range of step 1, or a (begin, end) pair."""
    if rows is None:
        return 0, T_q
    if isinstance(rows, slice):
        if rows.step not in (None, 1):
            raise ValueError(f"{fn}: rows must be a contiguous range (step 1); got step "
                             f"{rows.step}")
        begin, end, _ = rows.indices(T_q)
        return begin, max(end, begin)
    if isinstance(rows, range):
        if rows.step != 1:
            raise ValueError(f"{fn}: rows must be a contiguous range (step 1); got step "
                             f"{rows.step}")
        return rows.start, rows.stop
    if isinstance(rows, (tuple, list)) and len(rows) == 2:
        return int(rows[0]), int(rows[1])
    raise TypeError(f"{fn}: rows must be None, a slice, a range or a (begin, end) pair; got "
                    f"{type(rows).__name__}")


def _variants(fn: str, window: Any, softcap: Any, alibi_slopes: Any, sinks: Any, mask: Any = None,
              key_lengths: Any = None, varlen: bool = False) -> dict:
    """The variant keyword arguments of the extension's entry points, checked and converted."""
    if isinstance(window, (bool, np.bool_)):
        raise TypeError(f"{fn}: window must be an integer or None; got bool")
    out = dict(
        window=window,
        softcap=opt_float(fn, "softcap", softcap),
        alibi_slopes=opt_vector(fn, "alibi_slopes", alibi_slopes),
        sinks=opt_vector(fn, "sinks", sinks),
    )
    if not varlen:
        out["mask"] = opt_mask4(fn, "mask", mask)
        out["key_lengths"] = None if key_lengths is None else index_vector(
            fn, "key_lengths", key_lengths)
    return out


def attention_backward(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    dout: Any,
    dq: Any = None,
    dk: Any = None,
    dv: Any = None,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    align: str = "bottom_right",
    layout: str = "bthd",
    threads: int = 0,
    isa: str = "auto",
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
    mask: Any = None,
    key_lengths: Any = None,
    dsinks: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    dropout_offset: int = 0,
) -> Tuple[Any, ...]:
    """Backward pass of :func:`attention_forward` (SPEC "Backward pass", 4.6–4.7).

    With D_t = ⟨dO_t, O_t⟩ (the softmax Jacobian applied row by row)::

        dS = A ⊙ (dO Vᵀ − D 1ᵀ),  dQ = s·dS K,  dK = s·Σ_group dSᵀ Q,  dV = Σ_group Aᵀ dO

    A is recomputed from q, k and the saved lse (no T×T buffer).

    Args:
        q, k, v, out: as given to / returned by the forward (same layout, options, dtype;
            dout, dq, dk, dv in that dtype too).
        lse: [B, H_q, T_q] from the forward (``return_lse=True``).
        dout: gradient of the loss w.r.t. out, out's shape (any strides, also stride 0).
        dq, dk, dv: optional outputs in the shapes of q, k, v (overwritten, not accumulated).
        scale, causal, align, layout, threads, isa: as for the forward — they must match it.
        window, softcap, alibi_slopes, sinks, mask, key_lengths: as for the forward (the same
            ones, or the gradients are of another function). A float mask gets no gradient.
        dropout_p, dropout_seed, dropout_offset: the forward's (the backward regenerates its
            mask from them).
        dsinks: optional [H_q] float32 output for d(sinks) (only with sinks).

    Returns:
        ``(dq, dk, dv)``, or ``(dq, dk, dv, dsinks)`` when ``sinks`` is given, with
        dσ_h = −Σ_{b,t} e^{σ_h − L_t} D_t (SPEC "Score variants": sinks).
    """
    fn = "attention_backward"
    check_layout(fn, layout)
    q, k, v = as_array(fn, "q", q), as_array(fn, "k", k), as_array(fn, "v", v)
    out, lse, dout = as_array(fn, "out", out), as_array(fn, "lse", lse), as_array(fn, "dout", dout)
    dq = new_empty(q, tuple(q.shape)) if dq is None else as_output(fn, "dq", dq)
    dk = new_empty(q, tuple(k.shape)) if dk is None else as_output(fn, "dk", dk)
    dv = new_empty(q, tuple(v.shape)) if dv is None else as_output(fn, "dv", dv)
    variants = _variants(fn, window, softcap, alibi_slopes, sinks, mask, key_lengths)
    dsinks = _dsinks_output(fn, q, variants["sinks"], dsinks)
    v4 = lambda name, x: view4(fn, name, x, layout)  # noqa: E731
    _C.attention_backward(
        v4("q", q), v4("k", k), v4("v", v), v4("out", out), lse, v4("dout", dout),
        v4("dq", dq), v4("dk", dk), v4("dv", dv), scale, causal, align, threads, isa,
        dsinks=dsinks, **variants,
        dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
    )
    return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)


def _dsinks_output(fn: str, like: Any, sinks: Any, dsinks: Any) -> Any:
    if dsinks is not None:
        if sinks is None:
            raise ValueError(f"{fn}: dsinks given without sinks (d(sinks) needs the sinks)")
        return as_output(fn, "dsinks", dsinks)
    if sinks is None:
        return None
    return new_empty(like, (int(sinks.shape[0]),) if sinks.ndim >= 1 else (0,), float32=True)


def attention_forward_varlen(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    out: Any = None,
    lse: Any = None,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    align: str = "bottom_right",
    threads: int = 0,
    isa: str = "auto",
    return_lse: bool = False,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    dropout_offset: int = 0,
) -> Any:
    """Attention over a packed batch of variable-length sequences (SPEC "Score variants":
    varlen; FlashAttention's ``flash_attn_varlen_func``).

    Sequence i owns query rows [cu_q[i], cu_q[i+1]) and keys [cu_k[i], cu_k[i+1]); no token
    attends across sequences; the causal alignment, the window and ALiBi positions are per
    sequence.

    Args:
        q: [total_q, H_q, d_h] float32, bfloat16 or float16, any strides.
        k, v: [total_k, H_kv, d_h] in q's dtype (out too; lse float32).
        cu_seqlens_q, cu_seqlens_k: [n + 1] int32 or int64 (or lists of ints): 0 first,
            non-decreasing, ending at total_q / total_k (ArgumentError naming the index
            otherwise).
        out: optional [total_q, H_q, d_h] output; lse: optional [H_q, total_q] output.
        scale, causal, align, threads, isa, return_lse: as for :func:`attention_forward`.
        window, softcap, alibi_slopes, sinks: the score variants (no mask or key_lengths here:
            the offsets are the padding).

    Returns:
        ``out``, or ``(out, lse)`` when lse was given or ``return_lse`` is set.
    """
    fn = "attention_forward_varlen"
    q, k, v = as_array(fn, "q", q), as_array(fn, "k", k), as_array(fn, "v", v)
    cq = index_vector(fn, "cu_seqlens_q", cu_seqlens_q)
    ck = index_vector(fn, "cu_seqlens_k", cu_seqlens_k)
    out = new_empty(q, tuple(q.shape)) if out is None else as_output(fn, "out", out)
    if lse is None and return_lse:
        if q.ndim != 3:
            raise ValueError(f"{fn}: q must have 3 dimensions [total_q, H_q, d_h]; got shape "
                             f"{tuple(q.shape)}")
        lse = new_empty(q, (q.shape[1], q.shape[0]), float32=True)
    elif lse is not None:
        lse = as_output(fn, "lse", lse)
    _C.attention_forward_varlen(
        q, k, v, cq, ck, out, lse, scale, causal, align, threads, isa,
        **_variants(fn, window, softcap, alibi_slopes, sinks, varlen=True),
        dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
    )
    return (out, lse) if lse is not None else out


def attention_backward_varlen(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    dout: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    dq: Any = None,
    dk: Any = None,
    dv: Any = None,
    *,
    scale: Optional[float] = None,
    causal: bool = True,
    align: str = "bottom_right",
    threads: int = 0,
    isa: str = "auto",
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
    dsinks: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: int = 0,
    dropout_offset: int = 0,
) -> Tuple[Any, ...]:
    """Backward pass of :func:`attention_forward_varlen` (lse [H_q, total_q] from its
    ``return_lse=True``). Returns ``(dq, dk, dv)``, or ``(dq, dk, dv, dsinks)`` with sinks."""
    fn = "attention_backward_varlen"
    q, k, v = as_array(fn, "q", q), as_array(fn, "k", k), as_array(fn, "v", v)
    out, lse, dout = as_array(fn, "out", out), as_array(fn, "lse", lse), as_array(fn, "dout", dout)
    cq = index_vector(fn, "cu_seqlens_q", cu_seqlens_q)
    ck = index_vector(fn, "cu_seqlens_k", cu_seqlens_k)
    dq = new_empty(q, tuple(q.shape)) if dq is None else as_output(fn, "dq", dq)
    dk = new_empty(q, tuple(k.shape)) if dk is None else as_output(fn, "dk", dk)
    dv = new_empty(q, tuple(v.shape)) if dv is None else as_output(fn, "dv", dv)
    variants = _variants(fn, window, softcap, alibi_slopes, sinks, varlen=True)
    dsinks = _dsinks_output(fn, q, variants["sinks"], dsinks)
    _C.attention_backward_varlen(
        q, k, v, out, lse, dout, cq, ck, dq, dk, dv, scale, causal, align, threads, isa,
        dsinks=dsinks, **variants,
        dropout_p=dropout_p, dropout_seed=dropout_seed, dropout_offset=dropout_offset,
    )
    return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)


def attention_dropout_mask(
    B: int, H_q: int, T_q: int, T_k: int, dropout_p: float, dropout_seed: int,
    dropout_offset: int = 0, *, threads: int = 0,
) -> Any:
    """The dropout keep mask Z (docs/design.md D.2–D.3) as a bool array [B, H_q, T_q, T_k]
    (True = kept): the mask the entry points apply for these dropout arguments, wherever a
    weight is visible (varlen: sequence i is batch row i)."""
    keep = np.empty((int(B), int(H_q), int(T_q), int(T_k)), dtype=np.bool_)
    _C.attention_dropout_mask(keep, dropout_p, dropout_seed, dropout_offset, threads)
    return keep


def visible_keys(
    t: int, T_q: int, T_k: int, causal: bool = True, align: str = "bottom_right",
    window: Optional[int] = None,
) -> int:
    """pairs(t): number of keys query t sees (SPEC 4.3, "Useful-work counts"), with a sliding
    window W only the last W positions up to the query's (SPEC "Score variants"). Raises
    ArgumentError (code ``"invalid_argument"``) for t outside [0, T_q), a negative size, a
    window < 1 or an align other than ``"bottom_right"``/``"top_left"``."""
    if window is not None:
        return _C.visible_keys_windowed(t, T_q, T_k, causal, align, window)
    return _C.visible_keys(t, T_q, T_k, causal, align)


def visible_pairs(T_q: int, T_k: int, causal: bool = True, align: str = "bottom_right",
                  window: Optional[int] = None) -> int:
    """P = Σ_t pairs(t) (T(T+1)/2 for causal T_q = T_k = T; ≈ W·T_q with a window W ≪ T),
    exact. Raises ArgumentError as :func:`visible_keys`, with code ``"overflow"`` when P
    exceeds 2**63 − 1."""
    if window is not None:
        return _C.visible_pairs_windowed(T_q, T_k, causal, align, window)
    return _C.visible_pairs(T_q, T_k, causal, align)


def forward_flops(
    B: int, T_q: int, T_k: int, H_q: int, d_h: int, causal: bool = True,
    align: str = "bottom_right", window: Optional[int] = None,
) -> float:
    """Forward FLOPs 4·d_h·H_q·P·B (SPEC "Useful-work counts"), a float (no overflow); with a
    window only the pairs it leaves visible count. Raises ArgumentError for a negative size, a
    window < 1 or an unknown align."""
    if window is not None:
        return _C.forward_flops_windowed(B, T_q, T_k, H_q, d_h, causal, align, window)
    return _C.forward_flops(B, T_q, T_k, H_q, d_h, causal, align)


def backward_flops(
    B: int, T_q: int, T_k: int, H_q: int, d_h: int, causal: bool = True,
    align: str = "bottom_right", window: Optional[int] = None,
) -> float:
    """Backward FLOPs = 2.5 × :func:`forward_flops` (SPEC "Useful-work counts": five matrix
    products instead of two, the convention of the FlashAttention papers)."""
    if window is not None:
        return _C.backward_flops_windowed(B, T_q, T_k, H_q, d_h, causal, align, window)
    return _C.backward_flops(B, T_q, T_k, H_q, d_h, causal, align)
