"""The causal self-attention layer (SPEC 4.1–4.5): projections, RoPE, attention and the output
projection, forward and backward, and KV-cache inference (prefill, step).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Tuple

import numpy as np

from . import _tokenmix as _C
from ._convert import (
    as_array, as_output, contiguous, is_c_contiguous, is_torch, new_empty, opt_float, opt_vector,
)
from ._tokenmix import KVCache


class LayerGradients(NamedTuple):
    """Gradients of :meth:`CausalSelfAttention.backward` (NumPy arrays, or torch tensors
    sharing their memory when d_out was a tensor)."""

    d_u: Any  #: [B, T, d]
    d_w_q: Any  #: [d, H_q·d_h]
    d_w_k: Any  #: [d, H_kv·d_h]
    d_w_v: Any  #: [d, H_kv·d_h]
    d_w_o: Any  #: [H_q·d_h, d]
    d_sinks: Any = None  #: [H_q] d(sinks) when the layer has sinks, else None


class CausalSelfAttention:
    """The causal self-attention layer of SPEC 4.1–4.5, forward and backward::

        U [B, T, d]
        Q = U W_Q [B,T,H_q·d_h],  K = U W_K, V = U W_V [B,T,H_kv·d_h]     (4.1)
        Q, K ← RoPE(Q, K) at positions t (optional)                       (4.1)
        Y_h = softmax(s Q_h K_jᵀ + M) V_j  (causal, "bottom_right")     (4.2–4.5)
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
        window, softcap, alibi_slopes, sinks: the score variants (SPEC "Score variants used by
            real models"), as for attention_forward; they apply in forward/backward and in
            prefill/step (a rolling ``KVCache(window=W)`` needs the layer's window ≤ W). The
            slopes and sinks are copied. With sinks, backward's ``d_sinks`` is their gradient.

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
        window: Optional[int] = None,
        softcap: Optional[float] = None,
        alibi_slopes: Any = None,
        sinks: Any = None,
    ) -> None:
        if heads_kv is None:
            heads_kv = heads_q
        if head_dim is None:
            head_dim = d_model // heads_q if heads_q > 0 else 0
        fn = "CausalSelfAttention"
        self._impl = _C.CausalSelfAttention(
            d_model, heads_q, heads_kv, head_dim, rope, rope_base, scale, threads, isa,
            window=window, softcap=opt_float(fn, "softcap", softcap),
            alibi_slopes=opt_vector(fn, "alibi_slopes", alibi_slopes),
            sinks=opt_vector(fn, "sinks", sinks),
        )
        if seed is not None:
            self._impl.init_random(seed)

    # configuration
    d_model = property(lambda self: self._impl.d_model, doc="d")
    heads_q = property(lambda self: self._impl.heads_q, doc="H_q")
    heads_kv = property(lambda self: self._impl.heads_kv, doc="H_kv")
    head_dim = property(lambda self: self._impl.head_dim, doc="d_h")
    scale = property(lambda self: self._impl.scale, doc="s, or None for 1/sqrt(d_h)")
    window = property(lambda self: self._impl.window, doc="sliding window W, or None")
    softcap = property(lambda self: self._impl.softcap, doc="soft-capping c, or None")
    rope = property(lambda self: self._impl.rope, doc="RoPE pairing or None")
    rope_base = property(lambda self: self._impl.rope_base, doc="RoPE base")

    def _set(self, name: str, value: Any) -> None:
        view = getattr(self._impl, name)
        if is_torch(value):
            value = value.detach().cpu().numpy()
        value = np.asarray(value)
        if value.dtype.kind != "f":
            raise TypeError(
                f"CausalSelfAttention.{name}: weights must be floating point; got {value.dtype}"
            )
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
        u = contiguous(as_array(fn, "u", u))
        if out is None:
            out = new_empty(u, shape)
        else:
            out = as_output(fn, "out", out)
            if not is_c_contiguous(out):
                raise ValueError(f"{fn}: out must be C-contiguous")
        return u, out

    def forward(self, u: Any, out: Any = None) -> Any:
        """O = layer(U). u: [B, T, d] float32 (copied to C order if needed); out: optional
        C-contiguous [B, T, d]. Saves what :meth:`backward` needs. Returns out."""
        fn = "CausalSelfAttention.forward"
        shape = tuple(as_array(fn, "u", u).shape)
        u, out = self._io(fn, u, out, shape)
        self._impl.forward(u, out)
        return out

    __call__ = forward

    def backward(self, d_out: Any) -> LayerGradients:
        """From dO [B, T, d] of the most recent forward: dU and the four weight gradients (and
        d(sinks) when the layer has sinks)."""
        fn = "CausalSelfAttention.backward"
        d_out = as_array(fn, "d_out", d_out)
        grads = self._impl.backward(contiguous(d_out))
        if is_torch(d_out):
            import torch

            grads = tuple(None if g is None else torch.from_numpy(g) for g in grads)
        return LayerGradients(*grads)

    def prefill(
        self, u: Any, cache: KVCache, layer: int, out: Any = None, first_seq: int = 0
    ) -> Any:
        """Inference over ``T`` new tokens of sequences first_seq … first_seq + B − 1 of
        ``cache`` (their K/V are appended to layer ``layer``; RoPE positions continue from the
        cached length). u: [B, T, d]; returns out [B, T, d]."""
        fn = "CausalSelfAttention.prefill"
        shape = tuple(as_array(fn, "u", u).shape)
        u, out = self._io(fn, u, out, shape)
        self._impl.prefill(u, cache, layer, out, first_seq)
        return out

    def step(self, u: Any, cache: KVCache, layer: int, out: Any = None, first_seq: int = 0) -> Any:
        """One new token per sequence (prefill with T = 1): u and out are [B, d]."""
        fn = "CausalSelfAttention.step"
        shape = tuple(as_array(fn, "u", u).shape)
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
