"""tokenmix — exact causal self-attention, fast on CPUs (NumPy and PyTorch bindings).

The mathematics is SPEC.md's (equation numbers 4.1–4.8). Every function here works on NumPy
arrays and on PyTorch CPU tensors, **without copying**: arrays are handed to the C++ library
through DLPack / the buffer protocol together with their strides, so both the default layout
``[B, T, H, d_h]`` ("bthd") and PyTorch's SDPA layout ``[B, H, T, d_h]`` ("bhtd", pass
``layout="bhtd"``) and any other strided view (slices, transposes) are used in place. Outputs
are allocated with the library of the first input (NumPy in, NumPy out; torch in, torch out)
unless you pass your own (``out=...``), which is then written in place.

Shapes (logical, for ``layout="bthd"``; with ``"bhtd"`` axes 1 and 2 are swapped):

====== ========================== =============================================
name   shape                      meaning
====== ========================== =============================================
q      [B, T_q, H_q, d_h]         queries
k, v   [B, T_k, H_kv, d_h]        keys, values; H_kv divides H_q (GQA, 4.8)
out    [B, T_q, H_q, d_h]         O_h = softmax(s·Q_h K_jᵀ + M) V_j (4.2–4.5)
lse    [B, H_q, T_q]              row log-sum-exp L_t (4.4); always [B, H, T]
====== ========================== =============================================

Dtype policy: only float32 is computed. Any other dtype raises ``TypeError`` naming the
argument — no silent conversion (it would be a hidden copy and a silent precision change).
Errors from the C++ library raise :class:`ArgumentError` (a ``ValueError``) or
:class:`UnsupportedError` (a ``NotImplementedError``) with the library's message and an
attribute ``code`` (``"shape_mismatch"``, ``"aliasing"``, ...). The GIL is released while the
library computes.

For a differentiable, drop-in replacement of ``torch.nn.functional.scaled_dot_product_attention``
see :mod:`tokenmix.torch`; for a side-by-side benchmark run ``python -m tokenmix.bench``.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import numpy as np

from . import _tokenmix as _C
from ._tokenmix import ArgumentError, FileError, KVCache, UnsupportedError

__all__ = [
    "ArgumentError",
    "UnsupportedError",
    "FileError",
    "attention_forward",
    "attention_backward",
    "merge_partials",
    "rope_forward",
    "rope_backward",
    "logsumexp",
    "softmax",
    "softmax_jacobian",
    "softmax_jacobian_vector_product",
    "visible_keys",
    "visible_pairs",
    "forward_flops",
    "kv_cache_bytes",
    "KVCache",
    "attention_decode",
    "CausalSelfAttention",
    "LayerGradients",
    "version",
    "cpu_features",
    "available_isas",
    "resolve_isa",
    "default_threads",
    "describe_kernel",
    "__version__",
]

__version__: str = _C.version()
version = _C.version
cpu_features = _C.cpu_features
available_isas = _C.available_isas
default_threads = _C.default_threads
describe_kernel = _C.describe_kernel
kv_cache_bytes = _C.kv_cache_bytes

_LAYOUTS = ("bthd", "bhtd")


# ------------------------------------------------------------------------------------------------
# helpers


def _is_torch(x: Any) -> bool:
    return type(x).__module__.split(".", 1)[0] == "torch"


def _arr(fn: str, name: str, x: Any) -> Any:
    """Checks that x is an array the extension can take; detaches torch tensors (no copy)."""
    if isinstance(x, np.ndarray):
        return x
    if _is_torch(x):
        return x.detach() if x.requires_grad else x
    raise TypeError(
        f"{fn}: {name} must be a numpy.ndarray or a torch.Tensor; got {type(x).__name__}"
    )


def _out(fn: str, name: str, x: Any) -> Any:
    """Checks a caller-supplied output: an array, writable."""
    x = _arr(fn, name, x)
    if isinstance(x, np.ndarray) and not x.flags.writeable:
        raise ValueError(f"{fn}: {name} is read-only; outputs must be writable")
    return x


def _empty(like: Any, shape: Tuple[int, ...]) -> Any:
    """A float32 array of `shape` from the library of `like` (torch or NumPy)."""
    if _is_torch(like):
        import torch

        return torch.empty(shape, dtype=torch.float32)
    return np.empty(shape, dtype=np.float32)


def _swap12(x: Any) -> Any:
    """[B, H, T, D] <-> [B, T, H, D] as a view (no copy)."""
    if _is_torch(x):
        return x.permute(0, 2, 1, 3)
    return x.transpose(0, 2, 1, 3)


def _check_layout(fn: str, layout: str) -> None:
    if layout not in _LAYOUTS:
        raise ValueError(f"{fn}: layout must be 'bthd' or 'bhtd'; got {layout!r}")


def _view4(fn: str, name: str, x: Any, layout: str) -> Any:
    if x.ndim != 4:
        raise ValueError(
            f"{fn}: {name} must have 4 dimensions ([B, T, H, d_h], or [B, H, T, d_h] with "
            f"layout='bhtd'); got shape {tuple(x.shape)}"
        )
    return _swap12(x) if layout == "bhtd" else x


def _contiguous(x: Any) -> Any:
    if _is_torch(x):
        return x.contiguous()
    return np.ascontiguousarray(x)


def _is_c_contiguous(x: Any) -> bool:
    if _is_torch(x):
        return bool(x.is_contiguous())
    return bool(x.flags.c_contiguous)


# ------------------------------------------------------------------------------------------------
# attention


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
) -> Any:
    """Exact scaled-dot-product attention, forward (SPEC 4.2–4.5).

    Per query head h with KV head j = h // (H_q // H_kv) (4.8)::

        S = s · Q_h K_jᵀ            (4.2)   s = scale, default 1/sqrt(d_h)
        A = softmax(S + M)          (4.3, 4.4)   M: causal mask if causal
        O_h = A V_j                 (4.5)   L_t = log Σ_u exp(S_tu + M_tu)

    Args:
        q: [B, T_q, H_q, d_h] float32 (``layout="bhtd"``: [B, H_q, T_q, d_h]); any strides.
        k, v: [B, T_k, H_kv, d_h] float32 (or [B, H_kv, T_k, d_h]).
        out: optional output in q's layout and shape, written in place.
        lse: optional row log-sum-exp output [B, H_q, T_q], written in place.
        scale: s of (4.2); ``None`` = 1/sqrt(d_h).
        causal: apply the causal mask M (4.3).
        align: ``"bottom_right"`` (default: query t is at absolute position t + T_k − T_q, as
            KV-cache decoding needs) or ``"top_left"`` (query t sees keys u ≤ t, PyTorch's
            ``is_causal``). Identical when T_q == T_k. A query that sees no key gets O = 0,
            L = −inf.
        layout: ``"bthd"`` or ``"bhtd"`` — the memory order of q, k, v and out.
        threads: worker threads, 0 = all; results do not depend on it.
        isa: ``"auto"``, ``"portable"``, ``"avx2"`` or ``"avx512"`` (force a kernel path).
        return_lse: allocate and return lse as well.

    Returns:
        ``out``, or ``(out, lse)`` when lse was given or ``return_lse`` is set.
    """
    fn = "attention_forward"
    _check_layout(fn, layout)
    q, k, v = _arr(fn, "q", q), _arr(fn, "k", k), _arr(fn, "v", v)
    q4, k4, v4 = _view4(fn, "q", q, layout), _view4(fn, "k", k, layout), _view4(fn, "v", v, layout)
    B, T_q, H_q, _ = q4.shape
    out = _empty(q, tuple(q.shape)) if out is None else _out(fn, "out", out)
    if lse is None and return_lse:
        lse = _empty(q, (B, H_q, T_q))
    elif lse is not None:
        lse = _out(fn, "lse", lse)
    _C.attention_forward(
        q4, k4, v4, _view4(fn, "out", out, layout), lse, scale, causal, align, threads, isa
    )
    return (out, lse) if lse is not None else out


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
) -> Tuple[Any, Any, Any]:
    """Backward pass of :func:`attention_forward` (SPEC "Backward pass", 4.6–4.7).

    With D_t = ⟨dO_t, O_t⟩ (the softmax Jacobian applied row by row)::

        dS = A ⊙ (dO Vᵀ − D 1ᵀ),  dQ = s·dS K,  dK = s·Σ_group dSᵀ Q,  dV = Σ_group Aᵀ dO

    A is recomputed from q, k and the saved lse (no T×T buffer).

    Args:
        q, k, v, out: as given to / returned by the forward (same layout, options).
        lse: [B, H_q, T_q] from the forward (``return_lse=True``).
        dout: gradient of the loss w.r.t. out, out's shape (any strides, also stride 0).
        dq, dk, dv: optional outputs in the shapes of q, k, v (overwritten, not accumulated).
        scale, causal, align, layout, threads, isa: as for the forward — they must match it.

    Returns:
        ``(dq, dk, dv)``.
    """
    fn = "attention_backward"
    _check_layout(fn, layout)
    q, k, v = _arr(fn, "q", q), _arr(fn, "k", k), _arr(fn, "v", v)
    out, lse, dout = _arr(fn, "out", out), _arr(fn, "lse", lse), _arr(fn, "dout", dout)
    dq = _empty(q, tuple(q.shape)) if dq is None else _out(fn, "dq", dq)
    dk = _empty(q, tuple(k.shape)) if dk is None else _out(fn, "dk", dk)
    dv = _empty(q, tuple(v.shape)) if dv is None else _out(fn, "dv", dv)
    v4 = lambda name, x: _view4(fn, name, x, layout)  # noqa: E731
    _C.attention_backward(
        v4("q", q), v4("k", k), v4("v", v), v4("out", out), lse, v4("dout", dout),
        v4("dq", dq), v4("dk", dk), v4("dv", dv), scale, causal, align, threads, isa,
    )
    return dq, dk, dv


def merge_partials(
    o1: Any,
    lse1: Any,
    o2: Any,
    lse2: Any,
    out: Any = None,
    lse_out: Any = None,
    *,
    layout: str = "bthd",
) -> Tuple[Any, Any]:
    """Merges two partial attentions over disjoint key sets (SPEC "Merging partial results")::

        L = log(e^{L¹} + e^{L²}),   O = e^{L¹−L} O¹ + e^{L²−L} O²

    Args:
        o1, o2: [B, T, H, d_h] (or [B, H, T, d_h] with ``layout="bhtd"``).
        lse1, lse2: [B, H, T]. A part with L = −inf is empty and contributes nothing.
        out, lse_out: optional outputs; may be o1 / lse1 (in-place accumulation), not o2 / lse2.

    Returns:
        ``(out, lse_out)``.
    """
    fn = "merge_partials"
    _check_layout(fn, layout)
    o1, o2 = _arr(fn, "o1", o1), _arr(fn, "o2", o2)
    lse1, lse2 = _arr(fn, "lse1", lse1), _arr(fn, "lse2", lse2)
    out = _empty(o1, tuple(o1.shape)) if out is None else _out(fn, "out", out)
    lse_out = _empty(o1, tuple(lse1.shape)) if lse_out is None else _out(fn, "lse_out", lse_out)
    _C.merge_partials(
        _view4(fn, "o1", o1, layout), lse1, _view4(fn, "o2", o2, layout), lse2,
        _view4(fn, "out", out, layout), lse_out,
    )
    return out, lse_out


def visible_keys(t: int, T_q: int, T_k: int, causal: bool = True, align: str = "bottom_right") -> int:
    """pairs(t): number of keys query t sees (SPEC 4.3, "Useful-work counts")."""
    return _C.visible_keys(t, T_q, T_k, causal, align)


def visible_pairs(T_q: int, T_k: int, causal: bool = True, align: str = "bottom_right") -> int:
    """P = Σ_t pairs(t) (T(T+1)/2 for causal T_q = T_k = T)."""
    return _C.visible_pairs(T_q, T_k, causal, align)


def forward_flops(
    B: int, T_q: int, T_k: int, H_q: int, d_h: int, causal: bool = True,
    align: str = "bottom_right",
) -> float:
    """Forward FLOPs 4·d_h·H_q·P·B (SPEC "Useful-work counts"); backward is 2.5× this."""
    return _C.forward_flops(B, T_q, T_k, H_q, d_h, causal, align)


# ------------------------------------------------------------------------------------------------
# RoPE


def rope_forward(
    x: Any,
    *,
    pairing: str = "rotate_half",
    base: float = 10000.0,
    position_offset: int = 0,
    layout: str = "bthd",
) -> Any:
    """Rotary position embedding, in place (SPEC 4.1, RoPE).

    Pairs of coordinates of x[b, t, h] are rotated by φ = (position_offset + t)·θ_i,
    θ_i = base^(−2i/d_h): ``"rotate_half"`` pairs (x_i, x_{i+d_h/2}) (Llama/NeoX),
    ``"interleaved"`` pairs (x_{2i}, x_{2i+1}) (GPT-J/RoFormer); (x, y) ↦ (x cos φ − y sin φ,
    x sin φ + y cos φ).

    Args:
        x: [B, T, H, d_h] float32 (or [B, H, T, d_h] with ``layout="bhtd"``), d_h even; writable.

    Returns:
        x (rotated in place).
    """
    fn = "rope_forward"
    _check_layout(fn, layout)
    x = _out(fn, "x", x)
    _C.rope_forward(_view4(fn, "x", x, layout), pairing, base, position_offset)
    return x


def rope_backward(
    dx: Any,
    *,
    pairing: str = "rotate_half",
    base: float = 10000.0,
    position_offset: int = 0,
    layout: str = "bthd",
) -> Any:
    """Inverse rotation of a gradient, in place (angle −φ; rotations are orthogonal)."""
    fn = "rope_backward"
    _check_layout(fn, layout)
    dx = _out(fn, "dx", dx)
    _C.rope_backward(_view4(fn, "dx", dx, layout), pairing, base, position_offset)
    return dx


# ------------------------------------------------------------------------------------------------
# softmax and its Jacobian (SPEC 4.4, 4.6–4.7)


def logsumexp(z: Any) -> float:
    """log Σ_i exp(z_i) of a 1-D float32 array, stably (m + log Σ exp(z_i − m)). −inf entries
    are masked; all −inf gives −inf."""
    return _C.logsumexp(_contiguous(_arr("logsumexp", "z", z)))


def softmax(z: Any, out: Any = None) -> Any:
    """Row-wise stable softmax over the last axis (SPEC 4.4): a = exp(z − m) / Σ exp(z − m).

    Args:
        z: float32 array [..., n] (copied to C order if it is not).
        out: optional C-contiguous float32 output of z's shape; may be z itself.

    Returns:
        ``out`` [..., n]. −inf entries get probability 0; an all −inf row gives zeros.
    """
    fn = "softmax"
    z = _arr(fn, "z", z)
    if z.ndim < 1:
        raise ValueError(f"{fn}: z must have at least 1 dimension")
    n = int(z.shape[-1])
    if out is None:
        out = _empty(z, tuple(z.shape))
    else:
        out = _out(fn, "out", out)
        if tuple(out.shape) != tuple(z.shape):
            raise ValueError(f"{fn}: out must have z's shape {tuple(z.shape)}; got {tuple(out.shape)}")
        if not _is_c_contiguous(out):
            raise ValueError(f"{fn}: out must be C-contiguous")
    zc = _contiguous(z)
    _C.softmax_rows(zc.reshape(-1, n), out.reshape(-1, n))
    return out


def softmax_jacobian(a: Any, out: Any = None) -> Any:
    """The explicit Jacobian J = diag(a) − a aᵀ (4.6), J[i, j] = a_i (δ_ij − a_j) (4.7).

    Args:
        a: a softmax row, float32 [n].
        out: optional C-contiguous float32 [n, n].

    Returns:
        J [n, n] (symmetric, J·1 = 0, positive semidefinite).
    """
    fn = "softmax_jacobian"
    a = _contiguous(_arr(fn, "a", a))
    n = int(a.shape[0]) if a.ndim == 1 else -1
    out = _empty(a, (max(n, 0), max(n, 0))) if out is None else _out(fn, "out", out)
    _C.softmax_jacobian(a, out)
    return out


def softmax_jacobian_vector_product(a: Any, g: Any, out: Any = None) -> Any:
    """J g = a ⊙ (g − ⟨a, g⟩) without forming J (4.7).

    Args:
        a: a softmax row, float32 [n].  g: float32 [n].
        out: optional C-contiguous float32 [n]; may be g.

    Returns:
        J g [n].
    """
    fn = "softmax_jacobian_vector_product"
    a = _contiguous(_arr(fn, "a", a))
    g = _arr(fn, "g", g)
    out = _empty(a, tuple(a.shape)) if out is None else _out(fn, "out", out)
    _C.softmax_jacobian_vector_product(a, _contiguous(g), out)
    return out


def resolve_isa(isa: str = "auto") -> str:
    """The kernel path a call with ``isa`` would run ("portable", "avx2", "avx512");
    honours TOKENMIX_ISA for "auto". Raises UnsupportedError for a path this CPU/build lacks."""
    return _C.resolve_isa(isa)


# ------------------------------------------------------------------------------------------------
# KV cache and decode


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
) -> Any:
    """Attention of T_new new queries per sequence against layer ``layer`` of a KV cache.

    Query t of sequence b (cache length L_b, its own K/V already appended) sees keys
    u ≤ L_b − T_new + t (bottom-right causal mask, SPEC 4.3); GQA as in 4.8.

    Args:
        q: [B', T_new, H_q, d_h] float32 (``layout="bhtd"``: [B', H_q, T_new, d_h]); batch row b
            is cache sequence ``first_seq + b``.
        cache: a :class:`KVCache` with H_kv dividing H_q and the same d_h.
        out, lse: optional outputs ([B', T_new, H_q, d_h] in q's layout; [B', H_q, T_new]).

    Returns:
        ``out``, or ``(out, lse)`` when lse was given or ``return_lse`` is set.
    """
    fn = "attention_decode"
    _check_layout(fn, layout)
    q = _arr(fn, "q", q)
    q4 = _view4(fn, "q", q, layout)
    B, T_new, H_q, _ = q4.shape
    out = _empty(q, tuple(q.shape)) if out is None else _out(fn, "out", out)
    if lse is None and return_lse:
        lse = _empty(q, (B, H_q, T_new))
    elif lse is not None:
        lse = _out(fn, "lse", lse)
    _C.attention_decode(
        q4, cache, layer, _view4(fn, "out", out, layout), lse, scale, threads, isa, first_seq
    )
    return (out, lse) if lse is not None else out


# ------------------------------------------------------------------------------------------------
# the layer


class LayerGradients(NamedTuple):
    """Gradients of :meth:`CausalSelfAttention.backward` (NumPy arrays, or torch tensors
    sharing their memory when d_out was a tensor)."""

    d_u: Any  #: [B, T, d]
    d_w_q: Any  #: [d, H_q·d_h]
    d_w_k: Any  #: [d, H_kv·d_h]
    d_w_v: Any  #: [d, H_kv·d_h]
    d_w_o: Any  #: [H_q·d_h, d]


class CausalSelfAttention:
    """The causal self-attention layer of SPEC 4.1–4.5, forward and backward::

        U [B, T, d]
        Q = U W_Q [B,T,H_q·d_h],  K = U W_K, V = U W_V [B,T,H_kv·d_h]     (4.1)
        Q, K ← RoPE(Q, K) at positions t (optional)                       (4.1)
        Y_h = softmax(s Q_h K_jᵀ + M) V_j    (causal, bottom-right)        (4.2–4.5)
        O = [Y_1 | … | Y_{H_q}] W_O   [B, T, d]                           (4.5)

    Weights are row-major float32: W_Q [d, H_q·d_h], W_K and W_V [d, H_kv·d_h],
    W_O [H_q·d_h, d]. ``w_q`` etc. are writable NumPy views of the layer's own storage (no copy;
    ``torch.from_numpy(layer.w_q)`` shares it too); assigning ``layer.w_q = x`` copies x in
    (any real dtype is converted to float32 — it is a copy anyway). Weights start at zero;
    ``seed=`` or :meth:`init_random` fills them deterministically.

    Args:
        d_model: d.  heads_q: H_q.  heads_kv: H_kv (divides H_q; default H_q).
        head_dim: d_h (default d // H_q).
        rope: ``None``, ``"rotate_half"`` or ``"interleaved"``; rope_base: its base.
        scale: s (default 1/sqrt(d_h)); threads, isa: as for attention_forward.

    One object may be used from several Python threads; its calls are serialised.
    """

    def __init__(
        self,
        d_model: int,
        heads_q: int,
        heads_kv: Optional[int] = None,
        head_dim: Optional[int] = None,
        *,
        rope: Optional[str] = None,
        rope_base: float = 10000.0,
        scale: Optional[float] = None,
        threads: int = 0,
        isa: str = "auto",
        seed: Optional[int] = None,
    ) -> None:
        if heads_kv is None:
            heads_kv = heads_q
        if head_dim is None:
            head_dim = d_model // heads_q if heads_q > 0 else 0
        self._impl = _C.CausalSelfAttention(
            d_model, heads_q, heads_kv, head_dim, rope, rope_base, scale, threads, isa
        )
        if seed is not None:
            self._impl.init_random(seed)

    # configuration
    d_model = property(lambda self: self._impl.d_model, doc="d")
    heads_q = property(lambda self: self._impl.heads_q, doc="H_q")
    heads_kv = property(lambda self: self._impl.heads_kv, doc="H_kv")
    head_dim = property(lambda self: self._impl.head_dim, doc="d_h")
    scale = property(lambda self: self._impl.scale, doc="s, or None for 1/sqrt(d_h)")
    rope = property(lambda self: self._impl.rope, doc="RoPE pairing or None")
    rope_base = property(lambda self: self._impl.rope_base, doc="RoPE base")

    def _set(self, name: str, value: Any) -> None:
        view = getattr(self._impl, name)
        if _is_torch(value):
            value = value.detach().cpu().numpy()
        value = np.asarray(value)
        if value.dtype.kind != "f":
            raise TypeError(f"CausalSelfAttention.{name}: weights must be floating point; got {value.dtype}")
        if value.shape != view.shape:
            raise ValueError(
                f"CausalSelfAttention.{name}: expected shape {view.shape}; got {value.shape}"
            )
        np.copyto(view, value, casting="same_kind")

    w_q = property(lambda self: self._impl.w_q, lambda self, x: self._set("w_q", x),
                   doc="W_Q [d, H_q·d_h] (NumPy view of the layer's storage)")
    w_k = property(lambda self: self._impl.w_k, lambda self, x: self._set("w_k", x),
                   doc="W_K [d, H_kv·d_h]")
    w_v = property(lambda self: self._impl.w_v, lambda self, x: self._set("w_v", x),
                   doc="W_V [d, H_kv·d_h]")
    w_o = property(lambda self: self._impl.w_o, lambda self, x: self._set("w_o", x),
                   doc="W_O [H_q·d_h, d]")

    def init_random(self, seed: int) -> None:
        """Seeded uniform weights with variance 1/fan_in (deterministic per seed)."""
        self._impl.init_random(seed)

    def _io(self, fn: str, u: Any, out: Any, shape: Tuple[int, ...]) -> Tuple[Any, Any]:
        u = _contiguous(_arr(fn, "u", u))
        if out is None:
            out = _empty(u, shape)
        else:
            out = _out(fn, "out", out)
            if not _is_c_contiguous(out):
                raise ValueError(f"{fn}: out must be C-contiguous")
        return u, out

    def forward(self, u: Any, out: Any = None) -> Any:
        """O = layer(U). u: [B, T, d] float32 (copied to C order if needed); out: optional
        C-contiguous [B, T, d]. Saves what :meth:`backward` needs. Returns out."""
        fn = "CausalSelfAttention.forward"
        shape = tuple(_arr(fn, "u", u).shape)
        u, out = self._io(fn, u, out, shape)
        self._impl.forward(u, out)
        return out

    __call__ = forward

    def backward(self, d_out: Any) -> LayerGradients:
        """From dO [B, T, d] of the most recent forward: dU and the four weight gradients."""
        fn = "CausalSelfAttention.backward"
        d_out = _arr(fn, "d_out", d_out)
        grads = self._impl.backward(_contiguous(d_out))
        if _is_torch(d_out):
            import torch

            grads = tuple(torch.from_numpy(g) for g in grads)
        return LayerGradients(*grads)

    def prefill(self, u: Any, cache: KVCache, layer: int, out: Any = None, first_seq: int = 0) -> Any:
        """Inference over ``T`` new tokens of sequences first_seq … first_seq + B − 1 of
        ``cache`` (their K/V are appended to layer ``layer``; RoPE positions continue from the
        cached length). u: [B, T, d]; returns out [B, T, d]."""
        fn = "CausalSelfAttention.prefill"
        shape = tuple(_arr(fn, "u", u).shape)
        u, out = self._io(fn, u, out, shape)
        self._impl.prefill(u, cache, layer, out, first_seq)
        return out

    def step(self, u: Any, cache: KVCache, layer: int, out: Any = None, first_seq: int = 0) -> Any:
        """One new token per sequence (prefill with T = 1): u and out are [B, d]."""
        fn = "CausalSelfAttention.step"
        shape = tuple(_arr(fn, "u", u).shape)
        u, out = self._io(fn, u, out, shape)
        self._impl.step(u, cache, layer, out, first_seq)
        return out

    def saved(self) -> dict:
        """Copies of the attention-core tensors of the last forward: q [B,T,H_q,d_h] and
        k [B,T,H_kv,d_h] (after RoPE), v, y [B,T,H_q,d_h] (before W_O), lse [B,H_q,T]."""
        return self._impl.saved()

    def __repr__(self) -> str:
        return (
            f"CausalSelfAttention(d_model={self.d_model}, heads_q={self.heads_q}, "
            f"heads_kv={self.heads_kv}, head_dim={self.head_dim}, rope={self.rope!r})"
        )
