"""The KV cache (SPEC 4.8) and attention of new queries against it (decode).
"""

from __future__ import annotations

from typing import Any, Optional

from . import _tokenmix as _C
from ._convert import as_array, as_output, check_layout, new_empty, opt_float, opt_vector, view4
from ._tokenmix import KVCache

kv_cache_bytes = _C.kv_cache_bytes


def attention_decode(
    q: Any,
    cache: KVCache,
    layer: int,
    out: Any = None,
    lse: Any = None,
    *,
    scale: Optional[float] = None,
    threads: int = 0,
    isa: str = "auto",
    first_seq: int = 0,
    layout: str = "bthd",
    return_lse: bool = False,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
    alibi_slopes: Any = None,
    sinks: Any = None,
) -> Any:
    """Attention of T_new new queries per sequence against layer ``layer`` of a KV cache.

    Query t of sequence b (cache length L_b, its own K/V already appended) sees keys
    u ≤ L_b − T_new + t (``"bottom_right"`` causal mask, SPEC 4.3); GQA as in 4.8.

    Args:
        q: [B', T_new, H_q, d_h] float32, bfloat16 or float16 on a cache of any dtype; out in
            q's dtype, lse float32 (``layout="bhtd"``: [B', H_q, T_new, d_h]); batch row b
            is cache sequence ``first_seq + b``.
        cache: a :class:`KVCache` with H_kv dividing H_q and the same d_h.
        out, lse: optional outputs ([B', T_new, H_q, d_h] in q's layout; [B', H_q, T_new]).
        window, softcap, alibi_slopes, sinks: the score variants, as for
            :func:`tokenmix.attention_forward` (SPEC "Score variants used by real models"); with
            a window only the last W (+ T_new − 1) positions are read. A rolling cache
            (``KVCache(..., window=W)``) needs ``window`` ≤ W.

    Returns:
        ``out``, or ``(out, lse)`` when lse was given or ``return_lse`` is set.
    """
    fn = "attention_decode"
    check_layout(fn, layout)
    q = as_array(fn, "q", q)
    q4 = view4(fn, "q", q, layout)
    B, T_new, H_q, _ = q4.shape
    out = new_empty(q, tuple(q.shape)) if out is None else as_output(fn, "out", out)
    if lse is None and return_lse:
        lse = new_empty(q, (B, H_q, T_new), float32=True)
    elif lse is not None:
        lse = as_output(fn, "lse", lse)
    _C.attention_decode(
        q4, cache, layer, view4(fn, "out", out, layout), lse, scale, threads, isa, first_seq,
        window=window, softcap=opt_float(fn, "softcap", softcap),
        alibi_slopes=opt_vector(fn, "alibi_slopes", alibi_slopes),
        sinks=opt_vector(fn, "sinks", sinks),
    )
    return (out, lse) if lse is not None else out
