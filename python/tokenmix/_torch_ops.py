"""tokenmix's attention as registered PyTorch operators: ``torch.ops.tokenmix.*``.

Four ``torch.library.custom_op`` operators (float32, bfloat16 or float16 CPU tensors — q, k, v,
out and the gradients in one dtype, lse, sinks and dsinks float32, SPEC "Reduced precision";
the maths is SPEC 4.2–4.5, the backward pass and the score variants of SPEC "Score variants used
by real models"):

``tokenmix::attention_forward(q, k, v, attn_mask, alibi_slopes, sinks, scale, is_causal,
bottom_right, window, softcap, dropout_p=0.0, dropout_seed=None) -> (out, lse)``
    q ``[B, H_q, L, E]``, k/v ``[B, H_kv, S, E]`` (PyTorch's SDPA layout, any strides; H_q a
    multiple of H_kv: GQA, SPEC 4.8); ``attn_mask`` bool (True = may attend) or float32
    additive, rank 4 and broadcastable to ``[B, H_q, L, S]`` (size-1 axes are broadcast without
    a copy); ``alibi_slopes``/``sinks`` ``[H_q]``; ``bottom_right`` selects the alignment of
    the causal mask, the window and ALiBi (SPEC 4.3). ``out`` is ``[B, H_q, L, E]`` with the
    memory order of ``[B, L, H_q, E]`` (like PyTorch's CPU flash kernel: ``out.transpose(1, 2)``
    is contiguous, which is what transformers' attention layers want); ``lse`` ``[B, H_q, L]``
    is the row log-sum-exp L of SPEC (4.4) (not differentiable). ``dropout_p`` > 0 applies
    attention dropout (docs/design.md D.1–D.4) with the mask of ``dropout_seed``, an int64
    tensor ``[2]`` (seed, offset; the offset's low 32 bits): a tensor, so that a compiled graph
    draws a new one per call from PyTorch's generator instead of baking one in.
``tokenmix::attention_backward(dout, q, k, v, out, lse, <the same options>) -> (dq, dk, dv,
dsinks)``
    the gradients (dq/dk/dv with the strides of q/k/v when those are dense); ``dsinks`` is
    ``[H_q]``, or an empty ``[0]`` tensor when ``sinks`` is None.
``tokenmix::varlen_forward`` / ``tokenmix::varlen_backward``
    the packed variable-length form (``[total, H, E]`` with ``cu_seqlens_q/k`` offsets;
    ``lse`` ``[H_q, total_q]``).

Each has a fake (meta) implementation that computes the output shapes, so ``torch.compile``
(``fullgraph=True``) and ``torch.export`` trace through it without a graph break, and a vmap
rule (the vmapped dimension is merged into the batch when that is exact, otherwise the rule
loops over it). The forward operators have an autograd formula (``register_autograd`` with
``setup_context``) that calls the backward operator, for callers of ``torch.ops.tokenmix.*``
themselves. The backward operators are not differentiable: a double backward raises
``tokenmix.UnsupportedError``.

tokenmix.torch (and tokenmix.transformers) reach the operators through :func:`attention` and
:func:`varlen`: an ``autograd.Function`` with ``forward``, ``setup_context`` and ``backward``
apart and a generated vmap rule (``_Attention``; the autograd that ``register_autograd`` builds
has a combined forward, which ``torch.func.grad`` refuses), whose forward and backward call the
operators. Plain eager calls (no compile/export tracing, no functorch transform, no dispatch or
function mode, no tensor subclass: :func:`plain_eager`) skip the dispatcher: a ctx-style
Function (``_EagerAttention``) calls the same implementation functions directly, which costs a
few microseconds instead of the operator's few tens (generation calls attention thousands of
times a second); a call without score variants takes ``_EagerPlain``, with the fewest
arguments to apply and save and a backward that calls the pointer route itself. Both routes run
identical code and are tested against each other.

Threads: the implementations read ``torch.get_num_threads()`` when they run, outside any traced
region (an exported or compiled graph uses the thread count of the process that runs it); the
results do not depend on it. Tensors reach the extension as NumPy views (``.numpy()``: no copy,
strides kept), which is cheaper than torch's Python-level ``__dlpack__``.
"""

from typing import Any, Callable, List, Optional, Sequence, Tuple

import ml_dtypes
import torch
from torch import Tensor

from . import _native
from . import _tokenmix as _C

__all__ = ["attention", "attention_lse", "varlen", "plain_eager", "dropout_seed",
           "dropout_kwargs"]

_ALIGN = ("top_left", "bottom_right")


def _typed(kind: Any, code: str, msg: str) -> Exception:
    err = kind(msg)
    err.code = code
    return err


def _no_double_backward(op: str) -> Exception:
    return _typed(_C.UnsupportedError, "unsupported",
                  f"tokenmix.torch: double backward (differentiating {op}, the gradient of "
                  "tokenmix attention) is not supported; compute second derivatives with "
                  "torch.nn.functional.scaled_dot_product_attention")


def _np(t: Tensor) -> Any:
    """The NumPy view of a CPU tensor (no copy, strides kept, stride-0 broadcasts included).
    The extension takes tensors through DLPack too, but torch's ``__dlpack__`` is Python code
    that costs several microseconds per tensor; ``.numpy()`` is a C call."""
    t = t.detach() if t.requires_grad else t
    if t.dtype == torch.bfloat16:  # NumPy has no bfloat16: the same bits as ml_dtypes.bfloat16
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


# tokenmix::DType codes of the activation dtypes (_C._attention_*_ptr).
_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _check_qkv(op: str, q: Tensor, k: Tensor, v: Tensor) -> None:
    """_check(op, q=q, k=k, v=v) with the common case (one supported dtype, CPU) decided in a few
    attribute reads; anything else gets _check's messages."""
    dt = q.dtype
    if not (dt in _CODE and k.dtype == dt and v.dtype == dt and q.is_cpu and k.is_cpu
            and v.is_cpu):
        _check(op, q=q, k=k, v=v)


def _no_variants(attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
                 sinks: Optional[Tensor], window: Optional[int], softcap: Optional[float]) -> bool:
    return (attn_mask is None and alibi_slopes is None and sinks is None and window is None
            and softcap is None)


def _check(op: str, **tensors: Tensor) -> None:
    """float32, bfloat16 or float16 CPU tensors, all of one dtype (SPEC "Reduced precision"):
    else tokenmix.UnsupportedError."""
    first = next(iter(tensors.items()))
    for name, t in tensors.items():
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise _typed(_C.UnsupportedError, "unsupported",
                         f"tokenmix::{op}: {name} has dtype {t.dtype}; only torch.float32, "
                         "torch.bfloat16 and torch.float16 are supported")
        if t.dtype != first[1].dtype:
            raise _typed(_C.UnsupportedError, "unsupported",
                         f"tokenmix::{op}: {name} has dtype {t.dtype} but {first[0]} has "
                         f"{first[1].dtype}; {', '.join(tensors)} must have one dtype")
        if t.device.type not in ("cpu", "meta"):
            raise _typed(_C.UnsupportedError, "unsupported",
                         f"tokenmix::{op}: {name} is on device '{t.device}'; tokenmix runs on "
                         "the CPU only")


def _variant_kwargs(alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                    window: Optional[int], softcap: Optional[float]) -> dict:
    kw = {}
    if window is not None:
        kw["window"] = window
    if softcap is not None:
        kw["softcap"] = softcap
    if alibi_slopes is not None:
        kw["alibi_slopes"] = _np(alibi_slopes)
    if sinks is not None:
        kw["sinks"] = _np(sinks)
    return kw


def dropout_kwargs(dropout_p: float, dropout_seed: Optional[Tensor]) -> dict:
    """The extension's dropout arguments: seed and offset from the [2] int64 seed tensor (the
    offset's low 32 bits: Philox's counter word, D.3)."""
    if not dropout_p:
        return {}
    if dropout_seed is None or dropout_seed.numel() != 2 or dropout_seed.dtype != torch.int64:
        raise _typed(_C.ArgumentError, "invalid_argument",
                     "tokenmix: dropout_p > 0 needs dropout_seed, an int64 tensor [2] (seed, "
                     f"offset); got {None if dropout_seed is None else tuple(dropout_seed.shape)}")
    seed, offset = (int(x) for x in dropout_seed.tolist())
    return {"dropout_p": float(dropout_p), "dropout_seed": seed,
            "dropout_offset": offset & 0xFFFFFFFF}


# ---------------------------------------------------------------------------------------------
# Implementations (run eagerly: inside an operator call, or from the eager autograd.Function)


def _plain_forward(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float], is_causal: bool,
                   bottom_right: bool) -> Tuple[Tensor, Tensor]:
    """_forward_impl without score variants (generation's and training's common call): the
    tensors' pointers, shapes and strides, no NumPy views or transposed tensors (each costs
    microseconds; the kernels take fewer)."""
    _check_qkv("attention_forward", q, k, v)
    B, H, L, E = qs = q.shape
    dt = q.dtype
    out_bthd = torch.empty((B, L, H, E), dtype=dt)  # q's dtype (SPEC "Reduced precision")
    lse = torch.empty((B, H, L), dtype=torch.float32)  # float32 for every dtype
    code = _CODE[dt]
    _C._attention_forward_ptr(q.data_ptr(), code, qs, q.stride(), k.data_ptr(), code, k.shape,
                              k.stride(), v.data_ptr(), code, v.shape, v.stride(),
                              out_bthd.data_ptr(), out_bthd.stride(), lse.data_ptr(),
                              lse.stride(), scale, is_causal, bottom_right,
                              torch.get_num_threads())
    return out_bthd.transpose(1, 2), lse


def _plain_forward_no_lse(q: Tensor, k: Tensor, v: Tensor, scale: Optional[float],
                          is_causal: bool) -> Tensor:
    """_plain_forward for a call with nothing to differentiate (inference, generation): no
    log-sum-exp is allocated or written, and out is allocated [B, H_q, L, E] as returned (no
    transposed view): two tensor operations fewer on the path a decode step pays every call."""
    _check_qkv("attention_forward", q, k, v)
    qs = q.shape
    dt = q.dtype
    out = torch.empty(qs, dtype=dt)  # q's dtype (SPEC "Reduced precision")
    st = out.stride()
    code = _CODE[dt]
    # The pointer route takes out's strides in [B, L, H, E] order.
    _C._attention_forward_ptr(q.data_ptr(), code, qs, q.stride(), k.data_ptr(), code, k.shape,
                              k.stride(), v.data_ptr(), code, v.shape, v.stride(),
                              out.data_ptr(), (st[0], st[2], st[1], st[3]), 0, (0, 0, 0), scale,
                              is_causal, False, torch.get_num_threads())
    return out


def _plain_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    scale: Optional[float], is_causal: bool,
                    bottom_right: bool) -> Optional[Tuple[Tensor, Tensor, Tensor]]:
    """(dq, dk, dv) of _backward_impl without score variants, by pointers; None when out, lse
    or dout are not what the pointer route assumes (then _backward_impl's general route
    runs, whose messages name the argument)."""
    _check_qkv("attention_backward", q, k, v)
    dt = q.dtype
    if dout.dtype != dt:
        dout = dout.to(dt)
    qs = q.shape
    if not (out.dtype == dt and lse.dtype == torch.float32 and out.shape == qs
            and dout.shape == qs and lse.shape == qs[:3] and out.is_cpu and dout.is_cpu
            and lse.is_cpu):
        return None
    # Gradients with the strides of q, k, v (_grad_like).
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _C._attention_backward_ptr(q.data_ptr(), _CODE[dt], qs, q.stride(), k.data_ptr(), k.shape,
                               k.stride(), v.data_ptr(), v.shape, v.stride(), out.data_ptr(),
                               out.stride(), lse.data_ptr(), lse.stride(), dout.data_ptr(),
                               dout.stride(), dq.data_ptr(), dq.stride(), dk.data_ptr(),
                               dk.stride(), dv.data_ptr(), dv.stride(), scale, is_causal,
                               bottom_right, torch.get_num_threads())
    return dq, dk, dv


def _forward_impl(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                  alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], scale: Optional[float],
                  is_causal: bool, bottom_right: bool, window: Optional[int],
                  softcap: Optional[float], dropout_p: float = 0.0,
                  dropout_seed: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    if _no_variants(attn_mask, alibi_slopes, sinks, window, softcap) and not dropout_p:
        return _plain_forward(q, k, v, scale, is_causal, bottom_right)
    _check_qkv("attention_forward", q, k, v)
    B, H, L, E = q.shape
    out_bthd = torch.empty((B, L, H, E), dtype=q.dtype)  # q's dtype (SPEC "Reduced precision")
    lse = torch.empty((B, H, L), dtype=torch.float32)  # float32 for every dtype
    kw = _variant_kwargs(alibi_slopes, sinks, window, softcap)
    kw.update(dropout_kwargs(dropout_p, dropout_seed))
    if attn_mask is not None:
        kw["mask"] = _np(attn_mask)
    _C.attention_forward(_np(q.transpose(1, 2)), _np(k.transpose(1, 2)), _np(v.transpose(1, 2)),
                         _np(out_bthd), lse.numpy(), scale, is_causal, _ALIGN[bottom_right],
                         torch.get_num_threads(), "auto", **kw)
    return out_bthd.transpose(1, 2), lse


def _grad_like(x: Tensor) -> Tensor:
    """An output for the gradient of x, in x's dtype and with x's strides when those are dense
    (so a gradient flowing back through a transposed view needs no copy)."""
    return torch.empty_like(x)


def _backward_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                   attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
                   sinks: Optional[Tensor], scale: Optional[float], is_causal: bool,
                   bottom_right: bool, window: Optional[int], softcap: Optional[float],
                   dropout_p: float = 0.0,
                   dropout_seed: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    if _no_variants(attn_mask, alibi_slopes, sinks, window, softcap) and not dropout_p:
        grads = _plain_backward(dout, q, k, v, out, lse, scale, is_causal, bottom_right)
        if grads is not None:
            return grads + (torch.empty((0,), dtype=torch.float32),)
    _check_qkv("attention_backward", q, k, v)
    dt = q.dtype
    if dout.dtype != dt:
        dout = dout.to(dt)
    dq, dk, dv = _grad_like(q), _grad_like(k), _grad_like(v)
    dsinks = torch.empty((0 if sinks is None else sinks.shape[0],), dtype=torch.float32)
    kw = _variant_kwargs(alibi_slopes, sinks, window, softcap)
    kw.update(dropout_kwargs(dropout_p, dropout_seed))
    if attn_mask is not None:
        kw["mask"] = _np(attn_mask)
    if sinks is not None:
        kw["dsinks"] = dsinks.numpy()
    t = (lambda x: _np(x.transpose(1, 2)))
    _C.attention_backward(t(q), t(k), t(v), t(out), _np(lse), t(dout), t(dq), t(dk), t(dv), scale,
                          is_causal, _ALIGN[bottom_right], torch.get_num_threads(), "auto", **kw)
    return dq, dk, dv, dsinks


def _varlen_forward_impl(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                         cu_seqlens_k: Tensor, alibi_slopes: Optional[Tensor],
                         sinks: Optional[Tensor], scale: Optional[float], is_causal: bool,
                         bottom_right: bool, window: Optional[int], softcap: Optional[float],
                         dropout_p: float = 0.0,
                         dropout_seed: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    _check("varlen_forward", q=q, k=k, v=v)
    out = torch.empty(q.shape, dtype=q.dtype)
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32)
    _C.attention_forward_varlen(_np(q), _np(k), _np(v), _np(cu_seqlens_q), _np(cu_seqlens_k),
                                _np(out), lse.numpy(), scale, is_causal, _ALIGN[bottom_right],
                                torch.get_num_threads(), "auto",
                                **_variant_kwargs(alibi_slopes, sinks, window, softcap),
                                **dropout_kwargs(dropout_p, dropout_seed))
    return out, lse


def _varlen_backward_impl(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                          cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                          alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                          scale: Optional[float], is_causal: bool, bottom_right: bool,
                          window: Optional[int], softcap: Optional[float],
                          dropout_p: float = 0.0, dropout_seed: Optional[Tensor] = None
                          ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    _check("varlen_backward", q=q, k=k, v=v)
    if dout.dtype != q.dtype:
        dout = dout.to(q.dtype)
    dq, dk, dv = _grad_like(q), _grad_like(k), _grad_like(v)
    dsinks = torch.empty((0 if sinks is None else sinks.shape[0],), dtype=torch.float32)
    kw = _variant_kwargs(alibi_slopes, sinks, window, softcap)
    kw.update(dropout_kwargs(dropout_p, dropout_seed))
    if sinks is not None:
        kw["dsinks"] = dsinks.numpy()
    _C.attention_backward_varlen(*[_np(x) for x in (q, k, v, out, lse, dout, cu_seqlens_q,
                                                    cu_seqlens_k, dq, dk, dv)],
                                 scale, is_causal, _ALIGN[bottom_right], torch.get_num_threads(),
                                 "auto", **kw)
    return dq, dk, dv, dsinks


# ---------------------------------------------------------------------------------------------
# The operators


@torch.library.custom_op("tokenmix::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                      alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                      scale: Optional[float], is_causal: bool, bottom_right: bool,
                      window: Optional[int], softcap: Optional[float], dropout_p: float = 0.0,
                      dropout_seed: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """out, lse = attention(q [B,H_q,L,E], k/v [B,H_kv,S,E]); see the module's docstring."""
    return _forward_impl(q, k, v, attn_mask, alibi_slopes, sinks, scale, is_causal, bottom_right,
                         window, softcap, dropout_p, dropout_seed)


@attention_forward.register_fake
def _(q, k, v, attn_mask, alibi_slopes, sinks, scale, is_causal, bottom_right, window, softcap,
      dropout_p=0.0, dropout_seed=None):
    _check("attention_forward", q=q, k=k, v=v)
    B, H, L, E = q.shape
    return (q.new_empty((B, L, H, E)).transpose(1, 2),
            q.new_empty((B, H, L), dtype=torch.float32))


@torch.library.custom_op("tokenmix::attention_backward", mutates_args=())
def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                       attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
                       sinks: Optional[Tensor], scale: Optional[float], is_causal: bool,
                       bottom_right: bool, window: Optional[int], softcap: Optional[float],
                       dropout_p: float = 0.0, dropout_seed: Optional[Tensor] = None
                       ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, dsinks of attention_forward; see the module's docstring."""
    return _backward_impl(dout, q, k, v, out, lse, attn_mask, alibi_slopes, sinks, scale,
                          is_causal, bottom_right, window, softcap, dropout_p, dropout_seed)


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, attn_mask, alibi_slopes, sinks, scale, is_causal, bottom_right,
      window, softcap, dropout_p=0.0, dropout_seed=None):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty((0 if sinks is None else sinks.shape[0],), dtype=torch.float32))


@torch.library.custom_op("tokenmix::varlen_forward", mutates_args=())
def varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                   alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                   scale: Optional[float], is_causal: bool, bottom_right: bool,
                   window: Optional[int], softcap: Optional[float], dropout_p: float = 0.0,
                   dropout_seed: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """out [total_q, H_q, E], lse [H_q, total_q] of packed varlen attention."""
    return _varlen_forward_impl(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, scale,
                                is_causal, bottom_right, window, softcap, dropout_p,
                                dropout_seed)


@varlen_forward.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, scale, is_causal, bottom_right,
      window, softcap, dropout_p=0.0, dropout_seed=None):
    _check("varlen_forward", q=q, k=k, v=v)
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("tokenmix::varlen_backward", mutates_args=())
def varlen_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, alibi_slopes: Optional[Tensor],
                    sinks: Optional[Tensor], scale: Optional[float], is_causal: bool,
                    bottom_right: bool, window: Optional[int], softcap: Optional[float],
                    dropout_p: float = 0.0, dropout_seed: Optional[Tensor] = None
                    ) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """dq, dk, dv, dsinks of varlen_forward."""
    return _varlen_backward_impl(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                 alibi_slopes, sinks, scale, is_causal, bottom_right, window,
                                 softcap, dropout_p, dropout_seed)


@varlen_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, alibi_slopes, sinks, scale, is_causal,
      bottom_right, window, softcap, dropout_p=0.0, dropout_seed=None):
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v),
            q.new_empty((0 if sinks is None else sinks.shape[0],), dtype=torch.float32))


# ---------------------------------------------------------------------------------------------
# Autograd


def _check_no_grad(fn: str, needs: Sequence[bool], names: Sequence[Tuple[int, str]]) -> None:
    for i, name in names:
        if needs[i]:
            raise _typed(_C.UnsupportedError, "unsupported",
                         f"{fn}: {name} requires grad, but tokenmix computes no gradient for it "
                         f"(it would be silently missing); pass {name}.detach()")


def _forward_setup(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, Tensor]) -> None:
    q, k, v, attn_mask, alibi_slopes, sinks = inputs[:6]
    _check_no_grad("tokenmix::attention_forward", ctx.needs_input_grad,
                   ((3, "attn_mask"), (4, "alibi_slopes")))
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, attn_mask, alibi_slopes, sinks)
    ctx.options = tuple(inputs[6:])


def _forward_backward(ctx: Any, dout: Tensor, dlse: Optional[Tensor]) -> Tuple[Any, ...]:
    q, k, v, out, lse, attn_mask, alibi_slopes, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = attention_backward(dout, q, k, v, out, lse, attn_mask, alibi_slopes,
                                            sinks, *ctx.options)
    return (dq, dk, dv, None, None, None if sinks is None else dsinks) + (None,) * 7


attention_forward.register_autograd(_forward_backward, setup_context=_forward_setup)


def _varlen_setup(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, Tensor]) -> None:
    q, k, v, cu_q, cu_k, alibi_slopes, sinks = inputs[:7]
    _check_no_grad("tokenmix::varlen_forward", ctx.needs_input_grad, ((5, "alibi_slopes"),))
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi_slopes, sinks)
    ctx.options = tuple(inputs[7:])


def _varlen_backward(ctx: Any, dout: Tensor, dlse: Optional[Tensor]) -> Tuple[Any, ...]:
    q, k, v, out, lse, cu_q, cu_k, alibi_slopes, sinks = ctx.saved_tensors
    dq, dk, dv, dsinks = varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, alibi_slopes, sinks,
                                         *ctx.options)
    return (dq, dk, dv, None, None, None, None if sinks is None else dsinks) + (None,) * 7


varlen_forward.register_autograd(_varlen_backward, setup_context=_varlen_setup)


def _refuse_setup(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
    pass


def _refuse_attention(ctx: Any, *grads: Any) -> Any:
    raise _no_double_backward("tokenmix::attention_backward")


def _refuse_varlen(ctx: Any, *grads: Any) -> Any:
    raise _no_double_backward("tokenmix::varlen_backward")


attention_backward.register_autograd(_refuse_attention, setup_context=_refuse_setup)
varlen_backward.register_autograd(_refuse_varlen, setup_context=_refuse_setup)


# ---------------------------------------------------------------------------------------------
# vmap rules


def _loop_vmap(op: Callable, info: Any, in_dims: Tuple[Any, ...], args: Tuple[Any, ...]) -> Any:
    """The exact rule for any argument: one call per vmapped index, outputs stacked."""
    results: List[Tuple[Tensor, ...]] = []
    for i in range(info.batch_size):
        call = [a if d is None else a.select(d, i) for a, d in zip(args, in_dims)]
        results.append(op(*call))
    outs = tuple(torch.stack([r[j] for r in results]) for j in range(len(results[0])))
    return outs, (0,) * len(outs)


def _merge(x: Tensor, d: Optional[int], n: int) -> Tensor:
    """x (vmapped at d, or not vmapped) as [n·B, ...]: the vmapped axis merged into the batch."""
    x = x.unsqueeze(0).expand((n,) + tuple(x.shape)) if d is None else x.movedim(d, 0)
    return x.reshape((-1,) + tuple(x.shape[2:]))


def _merge_mask(m: Optional[Tensor], d: Optional[int], n: int, B: int) -> Optional[Tensor]:
    if m is None:
        return None
    if d is None and m.shape[0] == 1:
        return m  # broadcast over the merged batch as it was over B
    m = m.unsqueeze(0) if d is None else m.movedim(d, 0)
    m = m.expand((n, B) + tuple(m.shape[2:]))
    return m.reshape((n * B,) + tuple(m.shape[2:]))


def _split(x: Tensor, n: int) -> Tensor:
    return x.reshape((n, -1) + tuple(x.shape[1:]))


@attention_forward.register_vmap
def _(info, in_dims, q, k, v, attn_mask, alibi_slopes, sinks, *options):
    args = (q, k, v, attn_mask, alibi_slopes, sinks) + tuple(options)
    if in_dims[4] is not None or in_dims[5] is not None:  # per-index ALiBi slopes or sinks
        return _loop_vmap(attention_forward, info, in_dims, args)
    n = info.batch_size
    B = (q.shape[0] if in_dims[0] is None else q.shape[0 if in_dims[0] != 0 else 1])
    qm, km, vm = (_merge(x, d, n) for x, d in zip((q, k, v), in_dims[:3]))
    out, lse = attention_forward(qm, km, vm, _merge_mask(attn_mask, in_dims[3], n, B),
                                 alibi_slopes, sinks, *options)
    return (_split(out, n), _split(lse, n)), (0, 0)


@attention_backward.register_vmap
def _(info, in_dims, dout, q, k, v, out, lse, attn_mask, alibi_slopes, sinks, *options):
    args = (dout, q, k, v, out, lse, attn_mask, alibi_slopes, sinks) + tuple(options)
    # dsinks sums over the batch: a merged batch would sum over the vmapped axis too.
    if sinks is not None or in_dims[7] is not None:
        return _loop_vmap(attention_backward, info, in_dims, args)
    n = info.batch_size
    d0 = next(d for d in in_dims[:6] if d is not None)
    x0 = next(x for x, d in zip(args[:6], in_dims[:6]) if d is not None)
    B = x0.shape[1 if d0 == 0 else 0]
    merged = [_merge(x, d, n) for x, d in zip(args[:6], in_dims[:6])]
    dq, dk, dv, dsinks = attention_backward(*merged, _merge_mask(attn_mask, in_dims[6], n, B),
                                            alibi_slopes, sinks, *options)
    return (_split(dq, n), _split(dk, n), _split(dv, n), dsinks), (0, 0, 0, None)


@varlen_forward.register_vmap
def _(info, in_dims, *args):
    return _loop_vmap(varlen_forward, info, in_dims, args)


@varlen_backward.register_vmap
def _(info, in_dims, *args):
    return _loop_vmap(varlen_backward, info, in_dims, args)


# ---------------------------------------------------------------------------------------------
# Entry points used by tokenmix.torch (and tokenmix.transformers)


def dropout_seed() -> Tensor:
    """A fresh dropout seed and offset, int64 [2], drawn from PyTorch's default CPU generator
    (so ``torch.manual_seed`` makes a run's masks repeat; under ``torch.compile`` the draw is part
    of the graph, a new one per call)."""
    return torch.randint(-(2**63), 2**63 - 1, (2,), dtype=torch.int64)


def plain_eager(*tensors: Tensor) -> bool:
    """True when nothing traces or transforms this call: no torch.compile/export tracing, no
    functorch transform (vmap, grad), no dispatch or function mode, no tensor subclass."""
    if torch.compiler.is_compiling() or torch.jit.is_tracing():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    if torch._C._len_torch_dispatch_stack() > 0 or torch._C._is_torch_function_mode_enabled():
        return False
    for t in tensors:
        if t is not None and type(t) is not Tensor and type(t) is not torch.nn.Parameter:
            return False
    return True


def _forward_call(*args: Any) -> Tuple[Tensor, Tensor]:
    """attention_forward: the implementation itself in plain eager mode, else the operator."""
    if plain_eager(*args[:3], args[5]):
        return _forward_impl(*args)
    return attention_forward(*args)


def _backward_call(*args: Any) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    if plain_eager(*args[:4], args[8]):
        return _backward_impl(*args)
    return attention_backward(*args)


def _varlen_forward_call(*args: Any) -> Tuple[Tensor, Tensor]:
    if plain_eager(*args[:3], args[6]):
        return _varlen_forward_impl(*args)
    return varlen_forward(*args)


def _varlen_backward_call(*args: Any) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    if plain_eager(*args[:4], args[9]):
        return _varlen_backward_impl(*args)
    return varlen_backward(*args)


class _AttentionBackward(torch.autograd.Function):
    """The backward as a function of its own, recorded only when the backward itself builds a
    graph (create_graph=True, torch.func.grad), so that differentiating it raises tokenmix's
    error (with setup_context and a generated vmap rule: functorch transforms work)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*args: Any) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        return _backward_call(*args)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise _no_double_backward("tokenmix::attention_backward")


class _VarlenBackward(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(*args: Any) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
        return _varlen_backward_call(*args)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        raise _no_double_backward("tokenmix::varlen_backward")


class _Attention(torch.autograd.Function):
    """(out, lse) = attention_forward(...) for tokenmix.torch: forward, setup_context and
    backward apart (what torch.func transforms need; the operator's own autograd formula, for
    callers of torch.ops.tokenmix.attention_forward, is a combined one that they reject), the
    vmap rule generated from the operators' rules."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor],
                attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
                options: Tuple[Any, ...]) -> Tuple[Tensor, Tensor]:
        return _forward_call(q, k, v, attn_mask, alibi_slopes, sinks, *options)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, Tensor]) -> None:
        q, k, v, sinks, attn_mask, alibi_slopes, options = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse, sinks, attn_mask, alibi_slopes)
        ctx.options = options

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dlse: Optional[Tensor]) -> Tuple[Any, ...]:
        q, k, v, out, lse, sinks, attn_mask, alibi_slopes = ctx.saved_tensors
        args = (dout, q, k, v, out, lse, attn_mask, alibi_slopes, sinks) + ctx.options
        if torch.is_grad_enabled():
            dq, dk, dv, dsinks = _AttentionBackward.apply(*args)
        else:
            dq, dk, dv, dsinks = _backward_call(*args)
        return dq, dk, dv, (None if sinks is None else dsinks), None, None, None


class _Varlen(torch.autograd.Function):
    """(out, lse) = varlen_forward(...) for tokenmix.torch.varlen_attention (as _Attention)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor], cu_q: Tensor,
                cu_k: Tensor, alibi_slopes: Optional[Tensor],
                options: Tuple[Any, ...]) -> Tuple[Tensor, Tensor]:
        return _varlen_forward_call(q, k, v, cu_q, cu_k, alibi_slopes, sinks, *options)

    @staticmethod
    def setup_context(ctx: Any, inputs: Tuple[Any, ...], output: Tuple[Tensor, Tensor]) -> None:
        q, k, v, sinks, cu_q, cu_k, alibi_slopes, options = inputs
        out, lse = output
        ctx.mark_non_differentiable(lse)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sinks, alibi_slopes)
        ctx.options = options

    @staticmethod
    def backward(ctx: Any, dout: Tensor, dlse: Optional[Tensor]) -> Tuple[Any, ...]:
        q, k, v, out, lse, cu_q, cu_k, sinks, alibi_slopes = ctx.saved_tensors
        args = (dout, q, k, v, out, lse, cu_q, cu_k, alibi_slopes, sinks) + ctx.options
        if torch.is_grad_enabled():
            dq, dk, dv, dsinks = _VarlenBackward.apply(*args)
        else:
            dq, dk, dv, dsinks = _varlen_backward_call(*args)
        return dq, dk, dv, (None if sinks is None else dsinks), None, None, None, None


class _EagerAttention(torch.autograd.Function):
    """_Attention for plain eager calls: the implementation without the dispatcher, and a
    forward(ctx, ...) that autograd applies without binding the signature each call (what a
    setup_context-style Function costs)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor],
                attn_mask: Optional[Tensor], alibi_slopes: Optional[Tensor],
                options: Tuple[Any, ...]) -> Tensor:
        out, lse = _forward_impl(q, k, v, attn_mask, alibi_slopes, sinks, *options)
        ctx.save_for_backward(q, k, v, out, lse, sinks, attn_mask, alibi_slopes)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> Tuple[Any, ...]:
        return _Attention.backward(ctx, dout, None)


class _EagerPlain(torch.autograd.Function):
    """_EagerAttention without score variants (no mask, ALiBi, sinks, window or cap): the
    fewest arguments to apply and to save, and a backward that calls the pointer route itself
    (what a tiny training step pays per call, issue 18)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, scale: Optional[float],
                is_causal: bool) -> Tensor:
        out, lse = _plain_forward(q, k, v, scale, is_causal, False)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (scale, is_causal)
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> Tuple[Any, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        scale, is_causal = ctx.options
        grads = None
        if not torch.is_grad_enabled() and plain_eager(dout):
            grads = _plain_backward(dout, q, k, v, out, lse, scale, is_causal, False)
        if grads is None:  # create_graph (double backward refused), a mode or subclass, ...
            args = (dout, q, k, v, out, lse, None, None, None, scale, is_causal, False, None,
                    None)
            if torch.is_grad_enabled():
                grads = _AttentionBackward.apply(*args)[:3]
            else:
                grads = _backward_call(*args)[:3]
        return grads + (None, None)


class _EagerVarlen(torch.autograd.Function):
    """_Varlen for plain eager calls (see _EagerAttention)."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, sinks: Optional[Tensor], cu_q: Tensor,
                cu_k: Tensor, alibi_slopes: Optional[Tensor], options: Tuple[Any, ...]) -> Tensor:
        out, lse = _varlen_forward_impl(q, k, v, cu_q, cu_k, alibi_slopes, sinks, *options)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, sinks, alibi_slopes)
        ctx.options = options
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> Tuple[Any, ...]:
        return _Varlen.backward(ctx, dout, None)


def attention(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
              alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], scale: Optional[float],
              is_causal: bool, bottom_right: bool, window: Optional[int],
              softcap: Optional[float], dropout_p: float = 0.0,
              dropout_seed: Optional[Tensor] = None) -> Tensor:
    """out = attention_forward(...)[0], differentiable w.r.t. q, k, v and sinks. Arguments are
    taken as checked (tokenmix.torch and tokenmix.transformers validate them; a mask or ALiBi
    slopes that require grad are refused there). dropout_p > 0 needs dropout_seed (an int64
    tensor [2], :func:`dropout_seed`)."""
    if (sinks is None and not bottom_right and not dropout_p and plain_eager(q, k, v)
            and _no_variants(attn_mask, alibi_slopes, None, window, softcap)):
        # The common call (generation's and a plain training step's).
        if not (torch.is_grad_enabled()
                and (q.requires_grad or k.requires_grad or v.requires_grad)):
            return _plain_forward_no_lse(q, k, v, scale, is_causal)
        if _native.attention is not None:  # the C++ autograd node (tokenmix._native)
            _check_qkv("attention_forward", q, k, v)
            return _native.attention(q, k, v, scale, is_causal)
        return _EagerPlain.apply(q, k, v, scale, is_causal)
    options = (scale, is_causal, bottom_right, window, softcap, dropout_p, dropout_seed)
    if plain_eager(q, k, v, sinks):
        if not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                             or (sinks is not None and sinks.requires_grad))):
            # Nothing to differentiate (inference, generation): no autograd node at all.
            return _forward_impl(q, k, v, attn_mask, alibi_slopes, sinks, *options)[0]
        return _EagerAttention.apply(q, k, v, sinks, attn_mask, alibi_slopes, options)
    return _Attention.apply(q, k, v, sinks, attn_mask, alibi_slopes, options)[0]


def attention_lse(q: Tensor, k: Tensor, v: Tensor, attn_mask: Optional[Tensor],
                  alibi_slopes: Optional[Tensor], sinks: Optional[Tensor],
                  scale: Optional[float], is_causal: bool, bottom_right: bool,
                  window: Optional[int], softcap: Optional[float], dropout_p: float = 0.0,
                  dropout_seed: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(out, lse): :func:`attention`'s out (differentiable as there) and the row log-sum-exp L
    of SPEC (4.4) ``[B, H_q, L]`` float32 (not differentiable), for the attention weights
    (tokenmix.attention_weights; tokenmix.transformers with ``output_attentions=True``)."""
    options = (scale, is_causal, bottom_right, window, softcap, dropout_p, dropout_seed)
    if plain_eager(q, k, v, sinks) and not (
            torch.is_grad_enabled() and any(x is not None and x.requires_grad
                                            for x in (q, k, v, sinks))):
        return _forward_impl(q, k, v, attn_mask, alibi_slopes, sinks, *options)
    return _Attention.apply(q, k, v, sinks, attn_mask, alibi_slopes, options)


def varlen(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
           alibi_slopes: Optional[Tensor], sinks: Optional[Tensor], scale: Optional[float],
           is_causal: bool, bottom_right: bool, window: Optional[int],
           softcap: Optional[float], dropout_p: float = 0.0,
           dropout_seed: Optional[Tensor] = None) -> Tensor:
    """out = varlen_forward(...)[0], differentiable w.r.t. q, k, v and sinks."""
    options = (scale, is_causal, bottom_right, window, softcap, dropout_p, dropout_seed)
    if plain_eager(q, k, v, sinks):
        return _EagerVarlen.apply(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, alibi_slopes,
                                  options)
    return _Varlen.apply(q, k, v, sinks, cu_seqlens_q, cu_seqlens_k, alibi_slopes, options)[0]
