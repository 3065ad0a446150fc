"""A differentiable drop-in for ``torch.nn.functional.scaled_dot_product_attention`` (CPU, fp32).

``tokenmix.torch.scaled_dot_product_attention`` has PyTorch's signature, layout and semantics::

    query [..., H_q, L, E]   key [..., H_kv, S, E]   value [..., H_kv, S, E]  →  [..., H_q, L, E]

    out = softmax(scale · Q Kᵀ + M) V       (SPEC 4.2–4.5; scale defaults to 1/sqrt(E))

computed by tokenmix's fused flash kernels, forward and backward (a ``torch.autograd.Function``
that saves ``out`` and the row log-sum-exp L and calls tokenmix's backward; no T×T matrix is
stored). Tensors are passed to the kernels as strided views, without copies: PyTorch's
``[B, H, T, E]`` layout, transposed views of ``[B, T, H, E]`` projections and other
non-contiguous inputs all work in place.

Alignment of the causal mask: like PyTorch, ``is_causal=True`` here is ``"top_left"`` aligned
when L ≠ S (query i sees keys j ≤ i). tokenmix's native API (``tokenmix.attention_forward``)
defaults to ``"bottom_right"`` alignment (query i sees j ≤ i + S − L, what KV-cache decoding
needs; SPEC 4.3). The two agree when L == S.

Supported: float32 CPU tensors, any number of batch dimensions (equal for q, k, v), grouped
query attention with ``enable_gqa=True`` (H_q a multiple of H_kv; as in PyTorch, H_q ≠ H_kv
without it is an error), ``scale``, ``is_causal``. Everything else raises
``NotImplementedError`` naming the argument: ``dropout_p > 0``, an ``attn_mask``, a non-CPU
device, a dtype other than float32, a value head width different from the query's, batch
dimensions that need broadcasting. Double backward is not supported.

Threads: the kernels use ``torch.get_num_threads()`` threads, so ``torch.set_num_threads``
controls both libraries.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Tuple

import torch
from torch.autograd.function import once_differentiable

from . import _tokenmix as _C

__all__ = ["scaled_dot_product_attention"]

_FN = "tokenmix.torch.scaled_dot_product_attention"


def _as_bhtd(x: torch.Tensor) -> torch.Tensor:
    """[..., H, T, E] → [B, H, T, E] (a view whenever the batch dims can be merged)."""
    if x.dim() == 2:
        return x.unsqueeze(0).unsqueeze(0)
    if x.dim() == 3:
        return x.unsqueeze(0)
    if x.dim() == 4:
        return x
    return x.reshape((-1,) + tuple(x.shape[-3:]))


def _bthd(x: torch.Tensor) -> torch.Tensor:
    """The logical [B, T, H, E] view tokenmix takes of a [B, H, T, E] tensor (no copy)."""
    return x.permute(0, 2, 1, 3)


class _TokenmixSDPA(torch.autograd.Function):
    """out = SDPA(q, k, v) with tokenmix's forward; backward from (q, k, v, out, lse)."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                is_causal: bool, scale: Optional[float]) -> torch.Tensor:
        q4 = _as_bhtd(query.detach())
        k4 = _as_bhtd(key.detach())
        v4 = _as_bhtd(value.detach())
        B, H_q, L, E = q4.shape
        out = torch.empty((B, H_q, L, E), dtype=torch.float32)
        lse = torch.empty((B, H_q, L), dtype=torch.float32)
        threads = torch.get_num_threads()
        _C.attention_forward(_bthd(q4), _bthd(k4), _bthd(v4), _bthd(out), lse, scale,
                             is_causal, "top_left", threads, "auto")
        ctx.save_for_backward(q4, k4, v4, out, lse)
        ctx.is_causal = is_causal
        ctx.scale = scale
        ctx.shapes = (query.shape, key.shape, value.shape)
        return out.view(query.shape[:-1] + (E,))

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> Tuple[Any, ...]:
        q4, k4, v4, out, lse = ctx.saved_tensors
        q_shape, k_shape, v_shape = ctx.shapes
        if grad_out.dtype != torch.float32 or grad_out.device.type != "cpu":
            grad_out = grad_out.to(device="cpu", dtype=torch.float32)
        do4 = _as_bhtd(grad_out)
        dq = torch.empty(q4.shape, dtype=torch.float32)
        dk = torch.empty(k4.shape, dtype=torch.float32)
        dv = torch.empty(v4.shape, dtype=torch.float32)
        _C.attention_backward(_bthd(q4), _bthd(k4), _bthd(v4), _bthd(out), lse, _bthd(do4),
                              _bthd(dq), _bthd(dk), _bthd(dv), ctx.scale, ctx.is_causal,
                              "top_left", torch.get_num_threads(), "auto")
        return dq.view(q_shape), dk.view(k_shape), dv.view(v_shape), None, None


def _unsupported(what: str) -> NotImplementedError:
    return NotImplementedError(f"{_FN}: {what}")


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: Optional[torch.Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on CPU float32.

    Args:
        query: [..., H_q, L, E] float32 CPU tensor (any strides).
        key: [..., H_kv, S, E].
        value: [..., H_kv, S, E] (value head width must equal E).
        attn_mask: must be ``None`` (NotImplementedError otherwise; use ``is_causal``).
        dropout_p: must be 0.0 (NotImplementedError otherwise).
        is_causal: causal mask, ``"top_left"`` aligned as in PyTorch (query i sees keys j ≤ i;
            SPEC 4.3); tokenmix's native default is ``"bottom_right"``.
        scale: s of SPEC (4.2); ``None`` = 1/sqrt(E).
        enable_gqa: allow H_q ≠ H_kv (H_q a multiple of H_kv; query head h reads KV head
            h // (H_q // H_kv), SPEC 4.8), as in PyTorch.

    Returns:
        [..., H_q, L, E] float32, differentiable w.r.t. query, key and value.

    Raises:
        NotImplementedError: for anything this drop-in does not implement (names the argument).
        RuntimeError: for inputs PyTorch rejects too (mismatched sizes, GQA without enable_gqa).
    """
    tensors = (("query", query), ("key", key), ("value", value))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_FN}: {name} must be a torch.Tensor; got {type(t).__name__}")
    if attn_mask is not None:
        raise _unsupported(
            "attn_mask is not supported (only attn_mask=None); use is_causal=True for the causal "
            "mask, or torch.nn.functional.scaled_dot_product_attention for arbitrary masks"
        )
    if dropout_p != 0.0:
        raise _unsupported(f"dropout_p={dropout_p} is not supported (only dropout_p=0.0)")
    for name, t in tensors:
        if t.device.type != "cpu":
            raise _unsupported(f"{name} is on device '{t.device}'; tokenmix runs on the CPU only")
        if t.dtype != torch.float32:
            raise _unsupported(f"{name} has dtype {t.dtype}; only torch.float32 is supported")
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
    return _TokenmixSDPA.apply(query, key, value, bool(is_causal), scale)
