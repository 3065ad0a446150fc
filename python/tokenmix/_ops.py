"""The smaller operations: merging partial attentions ("Merging partial results"), RoPE (SPEC
4.1), softmax and log-sum-exp (4.4) and the softmax Jacobian (4.6–4.7).
"""

from __future__ import annotations

from typing import Any, Tuple

from . import _tokenmix as _C
from ._convert import (
    as_array,
    as_output,
    check_layout,
    contiguous,
    is_c_contiguous,
    new_empty,
    view4,
)


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
    check_layout(fn, layout)
    o1, o2 = as_array(fn, "o1", o1), as_array(fn, "o2", o2)
    lse1, lse2 = as_array(fn, "lse1", lse1), as_array(fn, "lse2", lse2)
    out = new_empty(o1, tuple(o1.shape)) if out is None else as_output(fn, "out", out)
    if lse_out is None:
        lse_out = new_empty(o1, tuple(lse1.shape))
    else:
        lse_out = as_output(fn, "lse_out", lse_out)
    _C.merge_partials(
        view4(fn, "o1", o1, layout), lse1, view4(fn, "o2", o2, layout), lse2,
        view4(fn, "out", out, layout), lse_out,
    )
    return out, lse_out


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
    check_layout(fn, layout)
    x = as_output(fn, "x", x)
    _C.rope_forward(view4(fn, "x", x, layout), pairing, base, position_offset)
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
    check_layout(fn, layout)
    dx = as_output(fn, "dx", dx)
    _C.rope_backward(view4(fn, "dx", dx, layout), pairing, base, position_offset)
    return dx


def logsumexp(z: Any) -> float:
    """log Σ_i exp(z_i) of a 1-D float32 array, stably (m + log Σ exp(z_i − m)). −inf entries
    are masked; all −inf gives −inf."""
    return _C.logsumexp(contiguous(as_array("logsumexp", "z", z)))


def softmax(z: Any, out: Any = None) -> Any:
    """Row-wise stable softmax over the last axis (SPEC 4.4): a = exp(z − m) / Σ exp(z − m).

    Args:
        z: float32 array [..., n] (copied to C order if it is not).
        out: optional C-contiguous float32 output of z's shape; may be z itself.

    Returns:
        ``out`` [..., n]. −inf entries get probability 0; an all −inf row gives zeros.
    """
    fn = "softmax"
    z = as_array(fn, "z", z)
    if z.ndim < 1:
        raise ValueError(f"{fn}: z must have at least 1 dimension")
    n = int(z.shape[-1])
    if out is None:
        out = new_empty(z, tuple(z.shape))
    else:
        out = as_output(fn, "out", out)
        if tuple(out.shape) != tuple(z.shape):
            raise ValueError(
                f"{fn}: out must have z's shape {tuple(z.shape)}; got {tuple(out.shape)}"
            )
        if not is_c_contiguous(out):
            raise ValueError(f"{fn}: out must be C-contiguous")
    zc = contiguous(z)
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
    a = contiguous(as_array(fn, "a", a))
    n = int(a.shape[0]) if a.ndim == 1 else -1
    out = new_empty(a, (max(n, 0), max(n, 0))) if out is None else as_output(fn, "out", out)
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
    a = contiguous(as_array(fn, "a", a))
    g = as_array(fn, "g", g)
    out = new_empty(a, tuple(a.shape)) if out is None else as_output(fn, "out", out)
    _C.softmax_jacobian_vector_product(a, contiguous(g), out)
    return out
