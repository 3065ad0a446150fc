"""Score variants (SPEC "Score variants used by real models"): sliding window, logit soft-capping,
ALiBi, attention sinks, explicit bool/float masks, key padding and packed varlen batches — in the
NumPy API (tokenmix.attention_forward/backward, *_varlen) and the PyTorch drop-in
(tokenmix.torch.scaled_dot_product_attention, tokenmix.torch.varlen_attention).

Yardsticks, both float64:
  * PyTorch's SDPA with the variant written as an explicit ``attn_mask`` (bool for the causal
    mask, windows and padding; float for ALiBi; a sink is one extra key whose value is zero and
    whose score is σ_h, put in by the float mask — so d(sinks) is PyTorch's gradient of that mask
    column);
  * ``ref_attention`` below, the SPEC formulas written with torch ops (softcap has no SDPA
    spelling); it is itself checked against SDPA for every variant SDPA can express.
Gradients: float64 autograd of those yardsticks, plus one central finite difference in float32
for d(sinks). Tolerances: conftest.py (FWD_*, BWD_*).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tokenmix as tm
import tokenmix.torch as tmt
from conftest import BWD_ATOL, BWD_RTOL, FWD_ATOL, FWD_RTOL, assert_close

ALIGNS = ["bottom_right", "top_left"]


def isas():
    """Every kernel path this CPU has, and "auto" (which picks the fastest)."""
    return ["auto"] + tm.available_isas()


# ---------------------------------------------------------------------------------------------
# The float64 yardsticks


def positions(T_q: int, T_k: int, align: str) -> torch.Tensor:
    """p(t): the absolute position of query t (SPEC "Score variants", 4.3)."""
    return torch.arange(T_q) + ((T_k - T_q) if align == "bottom_right" else 0)


def visibility(B, H, T_q, T_k, *, causal, align, window=None, key_lengths=None, mask=None):
    """[B, H, T_q, T_k] bool: which keys each row may see (the mask part of S)."""
    p = positions(T_q, T_k, align)[:, None]
    u = torch.arange(T_k)[None, :]
    vis = torch.ones(B, H, T_q, T_k, dtype=torch.bool)
    if causal:
        vis &= u <= p
    if window is not None:
        vis &= u > p - window
    if key_lengths is not None:
        kl = torch.as_tensor(np.asarray(key_lengths)).long()
        vis &= u[None, None] < kl[:, None, None, None]
    if mask is not None and mask.dtype == torch.bool:
        vis &= mask
    return vis


def ref_attention(q, k, v, *, causal=True, align="bottom_right", scale=None, window=None,
                  softcap=None, alibi=None, sinks=None, mask=None, key_lengths=None):
    """SPEC's score variants, literally, in float64 torch (differentiable w.r.t. q, k, v, sinks).

    q [B, T_q, H_q, D], k/v [B, T_k, H_kv, D] (bthd); returns out (bthd) and lse [B, H_q, T_q].
    S = cap(s·⟨q, k⟩) + b_h(t, u) + bias; invisible keys −inf; a sink joins the denominator.
    """
    B, T_q, H_q, D = q.shape
    T_k, H_kv = k.shape[1], k.shape[2]
    g = H_q // H_kv
    s = 1.0 / math.sqrt(D) if scale is None else scale
    kk = k.repeat_interleave(g, dim=2)
    vv = v.repeat_interleave(g, dim=2)
    z = torch.einsum("bthd,buhd->bhtu", q, kk) * s  # (4.2)
    S = softcap * torch.tanh(z / softcap) if softcap is not None else z
    p = positions(T_q, T_k, align).double()
    if alibi is not None:
        dist = p[:, None] - torch.arange(T_k).double()[None, :]
        S = S - alibi.double()[None, :, None, None] * dist
    if mask is not None and mask.dtype != torch.bool:
        S = S + mask.double()
    vis = visibility(B, H_q, T_q, T_k, causal=causal, align=align, window=window,
                     key_lengths=key_lengths, mask=mask)
    S = S.masked_fill(~vis, -math.inf)
    m = S.amax(dim=-1, keepdim=True)
    if sinks is not None:
        m = torch.maximum(m, sinks.double()[None, :, None, None])
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m)).detach()
    e = torch.exp(S - m)
    denom = e.sum(dim=-1, keepdim=True)
    if sinks is not None:
        denom = denom + torch.exp(sinks.double()[None, :, None, None] - m)
    A = e / denom.clamp_min(1e-300)  # a row that sees nothing: A = 0, O = 0
    out = torch.einsum("bhtu,buhd->bthd", A, vv)
    lse = (m + torch.log(denom)).squeeze(-1)  # −inf for an empty row without sinks
    return out, lse


def sdpa_yardstick(q, k, v, mask, sinks=None, scale=None):
    """PyTorch SDPA (float64) with an explicit attn_mask; a sink is a zero key with a zero value
    whose score, σ_h, the float mask supplies. q [B,H_q,T_q,D], k/v [B,H_kv,T_k,D] (bhtd)."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                              enable_gqa=True)
    B, H_q, T_q, _ = q.shape
    bias = mask if mask.dtype != torch.bool else torch.zeros(mask.shape, dtype=torch.float64) \
        .masked_fill(~mask, -math.inf)
    bias = bias.expand(B, H_q, T_q, k.shape[2])
    sink_col = sinks[None, :, None, None].expand(B, H_q, T_q, 1)
    bias = torch.cat([bias, sink_col], dim=-1)
    zero = torch.zeros(k.shape[:2] + (1, k.shape[3]), dtype=k.dtype)
    return F.scaled_dot_product_attention(q, torch.cat([k, zero], 2), torch.cat([v, zero], 2),
                                          attn_mask=bias, scale=scale, enable_gqa=True)


def assert_lse_close(ours, ref, what):
    """Log-sum-exp: −inf exactly where the reference has it, close elsewhere."""
    ours, ref = t64(ours), t64(ref)
    finite = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(ours), finite), what
    assert torch.equal(ours[~finite], ref[~finite]), what
    assert_close(ours[finite], ref[finite], FWD_ATOL, FWD_RTOL, what)


def rand(*shape, scale=1.0):
    return (np.random.randn(*shape) * scale).astype(np.float32)


def t64(x):
    return torch.as_tensor(np.asarray(x)).double()


def ref_with_grads(q, k, v, dout, sinks=None, **kw):
    """ref_attention in float64 and its gradients for the upstream gradient dout."""
    q64, k64, v64 = (t64(x).requires_grad_() for x in (q, k, v))
    s64 = None if sinks is None else t64(sinks).requires_grad_()
    out, lse = ref_attention(q64, k64, v64, sinks=s64, **kw)
    (out * t64(dout)).sum().backward()
    grads = (q64.grad, k64.grad, v64.grad) + (() if s64 is None else (s64.grad,))
    return out.detach(), lse.detach(), grads


def alibi_slopes(H: int) -> np.ndarray:
    """The usual ALiBi slopes m_h = 2^(−8(h+1)/H) (SPEC "Score variants": ALiBi)."""
    return np.array([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=np.float32)


# ---------------------------------------------------------------------------------------------
# The yardsticks agree with each other


@pytest.mark.parametrize("align", ALIGNS)
def test_reference_matches_pytorch_sdpa_with_explicit_masks(align):
    B, T_q, T_k, H_q, H_kv, D = 2, 7, 11, 4, 2, 8
    q, k, v = t64(rand(B, T_q, H_q, D)), t64(rand(B, T_k, H_kv, D)), t64(rand(B, T_k, H_kv, D))
    slopes = t64(alibi_slopes(H_q))
    sinks = t64(rand(H_q))
    kl = [9, 5]
    bool_mask = torch.rand(B, 1, T_q, T_k) > 0.3
    vis = visibility(B, H_q, T_q, T_k, causal=True, align=align, window=4, key_lengths=kl,
                     mask=bool_mask)
    p = positions(T_q, T_k, align).double()
    bias = -slopes[None, :, None, None] * (p[:, None] - torch.arange(T_k).double()[None, :])
    bias = bias.masked_fill(~vis, -math.inf)
    bhtd = lambda x: x.transpose(1, 2)  # noqa: E731
    kw = dict(causal=True, align=align, window=4, key_lengths=kl, mask=bool_mask)
    for s in (None, sinks):
        ours, _ = ref_attention(q, k, v, alibi=slopes, sinks=s, **kw)
        theirs = bhtd(sdpa_yardstick(bhtd(q), bhtd(k), bhtd(v), bias, sinks=s))
        live = vis.any(-1).transpose(1, 2)[..., None].expand_as(ours)  # SDPA: NaN on empty rows
        if s is not None:
            live = torch.ones_like(live)
        assert torch.allclose(ours[live], theirs[live], atol=1e-12), s


# ---------------------------------------------------------------------------------------------
# NumPy API: each variant and combinations, forward and backward, every ISA path

VARIANTS = {
    "window": dict(window=5),
    "window1": dict(window=1),
    "softcap": dict(softcap=2.5),
    "alibi": dict(alibi=True),
    "sinks": dict(sinks=True),
    "bool_mask": dict(mask="bool"),
    "float_mask": dict(mask="float"),
    "key_lengths": dict(key_lengths=True),
    "all": dict(window=6, softcap=3.0, alibi=True, sinks=True, mask="bool", key_lengths=True),
    "softcap_alibi_sinks": dict(softcap=1.5, alibi=True, sinks=True),
}
# (B, T_q, T_k, H_q, H_kv, d_h): square, T_q < T_k, T_q > T_k (rows with no key), GQA, odd sizes,
# a tile-straddling length.
VSHAPES = [(2, 9, 9, 4, 2, 8), (1, 5, 23, 3, 1, 13), (2, 13, 6, 2, 2, 7), (1, 70, 70, 2, 1, 32)]


def make_variant(name, B, T_q, T_k, H_q):
    """The tokenmix keyword arguments and the reference's for VARIANTS[name]."""
    spec = VARIANTS[name]
    ours, ref = {}, {}
    if "window" in spec:
        ours["window"] = ref["window"] = spec["window"]
    if "softcap" in spec:
        ours["softcap"] = ref["softcap"] = spec["softcap"]
    if spec.get("alibi"):
        ours["alibi_slopes"] = alibi_slopes(H_q)
        ref["alibi"] = t64(ours["alibi_slopes"])
    if spec.get("sinks"):
        ours["sinks"] = rand(H_q)
    if spec.get("mask") == "bool":
        m = np.random.rand(B, 1, T_q, T_k) > 0.25  # broadcast over heads
        ours["mask"] = m
        ref["mask"] = torch.as_tensor(m)
    elif spec.get("mask") == "float":
        m = rand(1, H_q, T_q, T_k)  # broadcast over the batch
        m[..., 0, :] = -np.inf  # a row that sees nothing: O = 0
        ours["mask"] = m
        ref["mask"] = t64(m)
    if spec.get("key_lengths"):
        kl = np.array([max(1, T_k - 2 * b - 1) for b in range(B)], dtype=np.int32)
        ours["key_lengths"] = kl
        ref["key_lengths"] = kl
    return ours, ref


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("align", ALIGNS)
@pytest.mark.parametrize("shape", VSHAPES, ids=lambda s: "B%d_Tq%d_Tk%d_Hq%d_Hkv%d_d%d" % s)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_numpy_forward_and_backward_match_reference(variant, shape, align, isa):
    B, T_q, T_k, H_q, H_kv, D = shape
    q, k, v = rand(B, T_q, H_q, D), rand(B, T_k, H_kv, D), rand(B, T_k, H_kv, D)
    dout = rand(B, T_q, H_q, D)
    ours, ref = make_variant(variant, B, T_q, T_k, H_q)
    sinks = ours.get("sinks")
    out = np.full(q.shape, np.nan, np.float32)  # poisoned outputs
    lse = np.full((B, H_q, T_q), np.nan, np.float32)
    tm.attention_forward(q, k, v, out, lse, align=align, isa=isa, **ours)
    r_out, r_lse, r_grads = ref_with_grads(q, k, v, dout, sinks=sinks, align=align, **ref)
    what = f"{variant} {shape} {align} {isa}"
    assert np.isfinite(out).all(), what
    assert_close(out, r_out, FWD_ATOL, FWD_RTOL, "out " + what)
    assert_lse_close(lse, r_lse, "lse " + what)  # −inf exactly where expected
    grads = tm.attention_backward(q, k, v, out, lse, dout, align=align, isa=isa, **ours)
    assert len(grads) == (4 if sinks is not None else 3)
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, r_grads):
        assert_close(g, r, BWD_ATOL, BWD_RTOL, f"{name} {what}")


@pytest.mark.parametrize("align", ALIGNS)
def test_numpy_bhtd_layout_and_non_causal_variants(align):
    B, T_q, T_k, H_q, H_kv, D = 2, 6, 10, 4, 2, 16
    q, k, v = rand(B, H_q, T_q, D), rand(B, H_kv, T_k, D), rand(B, H_kv, T_k, D)
    kw = dict(window=3, softcap=4.0, alibi_slopes=alibi_slopes(H_q), sinks=rand(H_q))
    out = tm.attention_forward(q, k, v, layout="bhtd", causal=False, align=align, **kw)
    tr = lambda x: t64(x).transpose(1, 2)  # noqa: E731
    ref, _ = ref_attention(tr(q), tr(k), tr(v), causal=False, align=align, window=3, softcap=4.0,
                           alibi=t64(kw["alibi_slopes"]), sinks=t64(kw["sinks"]))
    assert_close(out, ref.transpose(1, 2), FWD_ATOL, FWD_RTOL, "bhtd")


def test_masks_broadcast_and_strided_without_copies():
    """Masks of every broadcast shape and stride pattern: size-1 axes, stride-0 views from
    numpy.broadcast_to / torch.expand, slices with steps, transposed memory."""
    B, T_q, T_k, H_q, H_kv, D = 2, 8, 12, 4, 2, 8
    q, k, v = rand(B, T_q, H_q, D), rand(B, T_k, H_kv, D), rand(B, T_k, H_kv, D)
    full = np.random.rand(B, H_q, T_q, 2 * T_k) > 0.3
    fbias = rand(B, H_q, T_k, T_q)  # transposed memory below
    cases = {
        "2d": full[0, 0, :, :T_k],
        "3d": full[0, :, :, :T_k],
        "b11k": full[:, :1, :1, :T_k],
        "broadcast_to": np.broadcast_to(full[:1, :1, :, :T_k], (B, H_q, T_q, T_k)),
        "step": full[:, :, :, ::2],
        "torch_expand": torch.as_tensor(np.ascontiguousarray(full[0, 0, :, :T_k]))
        .expand(B, H_q, T_q, T_k),
        "float_transposed": fbias.transpose(0, 1, 3, 2),
        "float_torch_expand": torch.as_tensor(rand(1, 1, 1, T_k)).expand(B, 1, T_q, T_k),
    }
    for name, m in cases.items():
        m4 = m if m.ndim == 4 else m[(None,) * (4 - m.ndim)]
        mt = torch.as_tensor(np.array(m4)) if isinstance(m4, np.ndarray) else m4  # a copy
        ref_mask = mt if mt.dtype == torch.bool else mt.double()
        out = tm.attention_forward(q, k, v, mask=m)
        ref, _ = ref_attention(t64(q), t64(k), t64(v), mask=ref_mask)
        assert_close(out, ref, FWD_ATOL, FWD_RTOL, name)
    assert cases["broadcast_to"].strides[:2] == (0, 0)  # really a broadcast, not a copy
    assert cases["torch_expand"].stride()[:2] == (0, 0)


def test_empty_rows_give_zero_and_lse_minus_inf_or_sink():
    """A row that sees no key: O = 0 and L = −inf; with sinks L = σ_h (SPEC "Score variants")."""
    B, T, H, D = 1, 5, 2, 4
    q, k, v = rand(B, T, H, D), rand(B, T, H, D), rand(B, T, H, D)
    mask = np.ones((T, T), dtype=bool)
    mask[2] = False
    out, lse = tm.attention_forward(q, k, v, mask=mask, return_lse=True)
    assert np.all(out[:, 2] == 0) and np.all(lse[:, :, 2] == -np.inf)
    assert np.isfinite(out).all()
    sinks = np.array([0.5, -1.25], dtype=np.float32)
    out, lse = tm.attention_forward(q, k, v, mask=mask, sinks=sinks, return_lse=True)
    assert np.all(out[:, 2] == 0)
    np.testing.assert_allclose(lse[0, :, 2], sinks, rtol=0, atol=1e-6)
    dq, dk, dv, ds = tm.attention_backward(q, k, v, out, lse, rand(B, T, H, D), mask=mask,
                                           sinks=sinks)
    assert all(np.isfinite(x).all() for x in (dq, dk, dv, ds))
    assert np.all(dq[:, 2] == 0)


def test_dsinks_by_finite_differences():
    """d(sinks) against central differences of the float32 loss ⟨O, dO⟩ (step 1e-2)."""
    B, T, H_q, H_kv, D = 2, 10, 4, 2, 8
    q, k, v = rand(B, T, H_q, D), rand(B, T, H_kv, D), rand(B, T, H_kv, D)
    dout = rand(B, T, H_q, D)
    sinks = rand(H_q)
    kw = dict(window=4, softcap=5.0)
    out, lse = tm.attention_forward(q, k, v, sinks=sinks, return_lse=True, **kw)
    *_, ds = tm.attention_backward(q, k, v, out, lse, dout, sinks=sinks, **kw)
    h = 1e-2
    for i in range(H_q):
        sp, sm = sinks.copy(), sinks.copy()
        sp[i] += h
        sm[i] -= h
        lp = float((tm.attention_forward(q, k, v, sinks=sp, **kw).astype(np.float64) * dout).sum())
        lm = float((tm.attention_forward(q, k, v, sinks=sm, **kw).astype(np.float64) * dout).sum())
        fd = (lp - lm) / (2 * h)
        assert abs(ds[i] - fd) <= 2e-3 + 2e-3 * abs(fd), (i, ds[i], fd)


def test_key_lengths_equal_slicing_the_keys():
    """Right padding: key_lengths[b] = n_b gives what attention over the first n_b keys gives."""
    B, T_q, T_k, H, D = 3, 4, 9, 2, 8
    q, k, v = rand(B, T_q, H, D), rand(B, T_k, H, D), rand(B, T_k, H, D)
    kl = np.array([9, 6, 4], dtype=np.int64)
    out = tm.attention_forward(q, k, v, key_lengths=kl, causal=False)
    for b in range(B):
        n = int(kl[b])
        one = tm.attention_forward(q[b:b + 1], k[b:b + 1, :n], v[b:b + 1, :n], causal=False)
        assert_close(out[b:b + 1], one, 1e-6, 1e-6, f"batch {b}")


# ---------------------------------------------------------------------------------------------
# NumPy varlen


def pack(seqs):
    return np.ascontiguousarray(np.concatenate(seqs, axis=0))


def cu(lengths, dtype=np.int32):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(dtype)


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("kw", [{}, dict(window=3), dict(softcap=2.0, sinks=True),
                                dict(alibi=True, causal=False)],
                         ids=["plain", "window", "softcap_sinks", "alibi_noncausal"])
def test_numpy_varlen_equals_per_sequence(kw, isa):
    H_q, H_kv, D = 4, 2, 8
    lq, lk = [3, 0, 7, 5], [5, 2, 7, 1]  # T_q < T_k, an empty sequence, T_q > T_k
    kw = dict(kw)
    if kw.pop("sinks", False):
        kw["sinks"] = rand(H_q)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = alibi_slopes(H_q)
    qs = [rand(n, H_q, D) for n in lq]
    ks = [rand(n, H_kv, D) for n in lk]
    vs = [rand(n, H_kv, D) for n in lk]
    dos = [rand(n, H_q, D) for n in lq]
    q, k, v, do = pack(qs), pack(ks), pack(vs), pack(dos)
    for dt in (np.int32, np.int64):
        out, lse = tm.attention_forward_varlen(q, k, v, cu(lq, dt), cu(lk, dt), return_lse=True,
                                               isa=isa, **kw)
        assert lse.shape == (H_q, sum(lq))
        grads = tm.attention_backward_varlen(q, k, v, out, lse, do, cu(lq, dt), cu(lk, dt),
                                             isa=isa, **kw)
        oq = ok = 0
        dsinks = 0.0
        for i, (a, b) in enumerate(zip(lq, lk)):
            if a == 0:  # no queries: its keys get no gradient
                assert np.all(grads[1][ok:ok + b] == 0) and np.all(grads[2][ok:ok + b] == 0)
                ok += b
                continue
            o1, l1 = tm.attention_forward(qs[i][None], ks[i][None], vs[i][None], isa="portable",
                                          return_lse=True, **kw)
            g1 = tm.attention_backward(qs[i][None], ks[i][None], vs[i][None], o1, l1,
                                       dos[i][None], isa="portable", **kw)
            assert_close(out[oq:oq + a], o1[0], FWD_ATOL, FWD_RTOL, f"out seq {i}")
            assert_lse_close(lse[:, oq:oq + a], l1[0], f"lse seq {i}")
            assert_close(grads[0][oq:oq + a], g1[0][0], BWD_ATOL, BWD_RTOL, f"dq seq {i}")
            assert_close(grads[1][ok:ok + b], g1[1][0], BWD_ATOL, BWD_RTOL, f"dk seq {i}")
            assert_close(grads[2][ok:ok + b], g1[2][0], BWD_ATOL, BWD_RTOL, f"dv seq {i}")
            if "sinks" in kw:
                dsinks = dsinks + g1[3]
            oq, ok = oq + a, ok + b
        if "sinks" in kw:
            assert_close(grads[3], dsinks, BWD_ATOL, BWD_RTOL, "dsinks")


@pytest.mark.parametrize(
    "cq,ck,needle",
    [
        ([0, 3, 2, 8], [0, 4, 6, 8], r"cu_seqlens_q.*\b2\b"),  # decreasing at index 2
        ([0, 3, 5, 9], [0, 4, 6, 8], "cu_seqlens_q"),  # ends past total_q = 8
        ([1, 3, 5, 8], [0, 4, 6, 8], "cu_seqlens_q"),  # does not start at 0
        ([0, 3, 5, 8], [0, 4, 8], "cu_seqlens"),  # lengths differ
        ([0, 3, 5, 8], [0, 4, 6, 7], "cu_seqlens_k"),  # ends before total_k
    ],
    ids=["decreasing", "past_end", "first_not_zero", "length", "short"],
)
def test_numpy_varlen_bad_offsets_raise_argument_error(cq, ck, needle):
    q, k = rand(8, 2, 4), rand(8, 2, 4)
    with pytest.raises(tm.ArgumentError, match=needle):
        tm.attention_forward_varlen(q, k, k, np.array(cq, np.int32), np.array(ck, np.int32))


# ---------------------------------------------------------------------------------------------
# NumPy errors


def test_numpy_variant_errors():
    q = rand(1, 4, 2, 8)
    fn = "attention_forward"
    cases = [
        (dict(window=0), tm.ArgumentError, "window"),
        (dict(window=-3), tm.ArgumentError, "window"),
        (dict(window="3"), TypeError, f"{fn}: window must be an integer"),
        (dict(window=True), TypeError, f"{fn}: window must be an integer or None; got bool"),
        (dict(softcap=0.0), tm.ArgumentError, "softcap"),
        (dict(softcap=-1.0), tm.ArgumentError, "softcap"),
        (dict(softcap=float("inf")), tm.ArgumentError, "softcap"),
        (dict(softcap="big"), TypeError, f"{fn}: softcap must be a real number"),
        (dict(alibi_slopes=np.ones(3, np.float32)), tm.ArgumentError, "alibi_slopes"),
        (dict(alibi_slopes=np.ones(2, np.float64)), TypeError, "alibi_slopes has dtype float64"),
        (dict(sinks=np.ones((2, 1), np.float32)), ValueError, "sinks must have 1 dimension"),
        (dict(sinks=np.ones(5, np.float32)), tm.ArgumentError, "sinks"),
        (dict(mask=np.ones((4, 5), bool)), tm.ArgumentError, "mask"),
        (dict(mask=np.ones((3, 1, 4, 4), bool)), tm.ArgumentError, "mask"),
        (dict(mask=np.ones((4, 4), np.int32)), TypeError, "mask has dtype int32; expected bool"),
        (dict(mask=np.ones((4, 4), np.float64)), TypeError, "mask has dtype float64"),
        (dict(mask=np.ones((1, 1, 1, 4, 4), bool)), ValueError, "mask must have at most 4"),
        (dict(mask="causal"), TypeError, "mask must be a numpy.ndarray or a torch.Tensor"),
        (dict(key_lengths=np.array([2.0])), TypeError, "key_lengths has dtype float64"),
        (dict(key_lengths=np.array([2, 2], np.int32)), tm.ArgumentError, "key_lengths"),
        (dict(key_lengths=np.array([5], np.int32)), tm.ArgumentError, "key_lengths"),
        (dict(key_lengths=np.array([-1], np.int64)), tm.ArgumentError, "key_lengths"),
    ]
    for kw, exc, needle in cases:
        with pytest.raises(exc, match=needle):
            tm.attention_forward(q, q, q, **kw)
    out, lse = tm.attention_forward(q, q, q, return_lse=True)
    with pytest.raises(ValueError, match="dsinks given without sinks"):
        tm.attention_backward(q, q, q, out, lse, q, dsinks=np.empty(2, np.float32))
    with pytest.raises(TypeError, match="attention_backward: dsinks has dtype float64"):
        tm.attention_backward(q, q, q, out, lse, q, sinks=[0.0, 0.0],
                              dsinks=np.empty(2, np.float64))
    with pytest.raises(TypeError, match="cu_seqlens_q has dtype float32"):
        tm.attention_forward_varlen(q[0], q[0], q[0], np.array([0, 4], np.float32), [0, 4])
    with pytest.raises(ValueError, match="attention_forward_varlen: q must have 3 dimensions"):
        tm.attention_forward_varlen(q, q, q, [0, 4], [0, 4])


# ---------------------------------------------------------------------------------------------
# PyTorch drop-in: attn_mask, padded batches, chunked prefill, variants, gradients


def sdpa_reference(q, k, v, g, **kw):
    """float64 SDPA: output and gradients w.r.t. q, k, v (and a float attn_mask)."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q64, k64, v64, **kw)
    out.backward(g.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


def check_torch(q, k, v, ref_kw, ours_kw, rows=None, what=""):
    """Ours (float32) vs float64 SDPA with ref_kw; `rows` ([B, L] bool) selects compared rows."""
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = tmt.scaled_dot_product_attention(q, k, v, **ours_kw)
    g = torch.randn_like(out)
    if rows is not None:
        g = g * rows[:, None, :, None]  # padding rows carry no gradient (their O is 0 here)
    out.backward(g)
    r_out, r_dq, r_dk, r_dv = sdpa_reference(q, k, v, g, **ref_kw)
    sel = (slice(None),) if rows is None else rows[:, None, :, None].expand_as(out)
    assert_close(out.detach()[sel], r_out[sel], FWD_ATOL, FWD_RTOL, "out " + what)
    assert_close(q.grad, torch.nan_to_num(r_dq), BWD_ATOL, BWD_RTOL, "dq " + what)
    assert_close(k.grad, r_dk, BWD_ATOL, BWD_RTOL, "dk " + what)
    assert_close(v.grad, r_dv, BWD_ATOL, BWD_RTOL, "dv " + what)
    return out


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("mshape", ["LS", "1LS", "B1LS", "BHLS", "B11S", "expand"])
def test_torch_attn_mask_bool_and_float_broadcast(kind, mshape):
    B, H_q, H_kv, L, S, E = 2, 4, 2, 7, 9, 8
    q, k, v = torch.randn(B, H_q, L, E), torch.randn(B, H_kv, S, E), torch.randn(B, H_kv, S, E)
    shapes = {"LS": (L, S), "1LS": (1, L, S), "B1LS": (B, 1, L, S), "BHLS": (B, H_q, L, S),
              "B11S": (B, 1, 1, S), "expand": (1, 1, L, S)}
    shape = shapes[mshape]
    if kind == "bool":
        mask = torch.rand(shape) > 0.3
        mask[..., 0] = True  # every row sees a key (older PyTorch gives NaN otherwise)
    else:
        mask = torch.randn(shape)
    if mshape == "expand":
        mask = mask.expand(B, H_q, L, S)  # stride 0, no copy
    ref_mask = mask if kind == "bool" else mask.double()
    check_torch(q, k, v, dict(attn_mask=ref_mask, enable_gqa=True),
                dict(attn_mask=mask, enable_gqa=True), what=f"{kind} {mshape}")


@pytest.mark.parametrize("side", ["left", "right"])
def test_torch_padded_batch_like_hugging_face(side):
    """A padded batch as Hugging Face builds it: causal ∧ key padding, as a bool mask and as a
    float mask (0 / −inf); real-token rows must equal PyTorch's; padding rows are 0, not NaN."""
    B, H, T, E = 3, 4, 12, 16
    lengths = [12, 7, 3]
    q, k, v = torch.randn(B, H, T, E), torch.randn(B, H, T, E), torch.randn(B, H, T, E)
    real = torch.zeros(B, T, dtype=torch.bool)
    for b, n in enumerate(lengths):
        if side == "left":
            real[b, T - n:] = True
        else:
            real[b, :n] = True
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    mask = causal[None, None] & real[:, None, None, :]  # [B, 1, T, T]
    rows = real.clone()
    for float_mask in (False, True):
        m = mask if not float_mask else torch.zeros(mask.shape).masked_fill(~mask, -math.inf)
        rm = m if not float_mask else m.double()
        out = check_torch(q, k, v, dict(attn_mask=rm), dict(attn_mask=m), rows=rows,
                          what=f"{side} float={float_mask}")
        assert torch.isfinite(out).all()
        empty = ~mask.any(-1)[:, 0]  # [B, T]: left padding's pad rows see no key
        assert bool(empty.any()) == (side == "left")
        assert (out.detach().transpose(1, 2)[empty] == 0).all()  # O = 0, not NaN
    # Hugging Face's own float mask uses finfo(float32).min, not −inf: then every row, padding
    # rows included, is PyTorch's (a fully "masked" row averages over all keys, as in PyTorch).
    hf = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    check_torch(q, k, v, dict(attn_mask=hf.double()), dict(attn_mask=hf), what=f"{side} finfo.min")
    if side == "right":  # key padding alone: the native key_lengths gives the same
        kl = torch.tensor(lengths, dtype=torch.int32)
        ours = tm.attention_forward(q, k, v, layout="bhtd", key_lengths=kl)
        ref = tmt.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        assert_close(ours.transpose(1, 2)[rows], ref.transpose(1, 2)[rows], 1e-6, 1e-6, "kl")


def test_torch_chunked_prefill_bottom_right():
    """T_q = 32 new queries over a 64-token cache (positions 32..63): PyTorch's is_causal cannot
    say it; causal_align="bottom_right" can, and equals SDPA with the mask written out."""
    B, H_q, H_kv, L, S, E = 2, 8, 2, 32, 64, 32
    q, k, v = torch.randn(B, H_q, L, E), torch.randn(B, H_kv, S, E), torch.randn(B, H_kv, S, E)
    mask = torch.arange(S)[None, :] <= torch.arange(L)[:, None] + (S - L)
    check_torch(q, k, v, dict(attn_mask=mask, enable_gqa=True),
                dict(is_causal=True, causal_align="bottom_right", enable_gqa=True),
                what="chunked prefill")
    # and with a sliding window of 16 on top
    W = 16
    wmask = mask & (torch.arange(S)[None, :] > torch.arange(L)[:, None] + (S - L) - W)
    check_torch(q, k, v, dict(attn_mask=wmask, enable_gqa=True),
                dict(is_causal=True, causal_align="bottom_right", window=W, enable_gqa=True),
                what="chunked prefill + window")
    # top-left (the default) is PyTorch's is_causal
    check_torch(q, k, v, dict(is_causal=True, enable_gqa=True),
                dict(is_causal=True, enable_gqa=True), what="top-left")


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
def test_torch_window_and_alibi_equal_explicit_masks(align):
    B, H_q, H_kv, L, S, E = 2, 4, 4, 10, 15, 8
    q, k, v = torch.randn(B, H_q, L, E), torch.randn(B, H_kv, S, E), torch.randn(B, H_kv, S, E)
    p = positions(L, S, align)
    u = torch.arange(S)
    causal = u[None, :] <= p[:, None]
    slopes = torch.tensor(alibi_slopes(H_q))
    bias = -slopes.double()[:, None, None] * (p[:, None] - u[None, :]).double()
    bias = bias.masked_fill(~causal, -math.inf)
    check_torch(q, k, v, dict(attn_mask=bias),
                dict(is_causal=True, causal_align=align, alibi_slopes=slopes), what="alibi")
    win = causal & (u[None, :] > p[:, None] - 4)
    check_torch(q, k, v, dict(attn_mask=win),
                dict(is_causal=True, causal_align=align, window=4), what="window")


@pytest.mark.parametrize("with_mask", [False, True])
def test_torch_sinks_gradient_equals_pytorch_mask_gradient(with_mask):
    """sinks (requires_grad) vs SDPA over one extra zero key whose score σ_h comes from a float
    attn_mask column: the output and d(sinks) (= PyTorch's gradient of that column, summed)."""
    B, H_q, H_kv, L, S, E = 2, 4, 2, 6, 8, 16
    q = torch.randn(B, H_q, L, E, requires_grad=True)
    k = torch.randn(B, H_kv, S, E, requires_grad=True)
    v = torch.randn(B, H_kv, S, E, requires_grad=True)
    sinks = torch.randn(H_q, requires_grad=True)
    mask = (torch.rand(B, 1, L, S) > 0.3) if with_mask else None
    out = tmt.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not with_mask,
                                           enable_gqa=True, sinks=sinks)
    g = torch.randn_like(out)
    out.backward(g)
    base = mask if with_mask else torch.ones(L, S, dtype=torch.bool).tril()
    bias = torch.zeros(base.shape, dtype=torch.float64).masked_fill(~base, -math.inf)
    bias = bias.expand(B, H_q, L, S)
    s64 = sinks.detach().double()
    col = s64[None, :, None, None].expand(B, H_q, L, 1).clone().requires_grad_()
    full = torch.cat([bias, col], dim=-1)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    zero = torch.zeros(B, H_kv, 1, E, dtype=torch.float64)
    ref = F.scaled_dot_product_attention(q64, torch.cat([k64, zero], 2),
                                         torch.cat([v64, zero], 2), attn_mask=full,
                                         enable_gqa=True)
    ref.backward(g.double())
    assert_close(out.detach(), ref.detach(), FWD_ATOL, FWD_RTOL, "out")
    assert_close(sinks.grad, col.grad.sum(dim=(0, 2, 3)), BWD_ATOL, BWD_RTOL, "dsinks")
    for ours, theirs, name in ((q.grad, q64.grad, "dq"), (k.grad, k64.grad, "dk"),
                               (v.grad, v64.grad, "dv")):
        assert_close(ours, theirs, BWD_ATOL, BWD_RTOL, name)


def test_torch_softcap_and_all_variants_against_reference():
    """softcap (no SDPA spelling) and every extra at once against ref_attention with autograd."""
    B, H_q, H_kv, L, S, E = 2, 4, 2, 9, 13, 8
    q = torch.randn(B, H_q, L, E, requires_grad=True)
    k = torch.randn(B, H_kv, S, E, requires_grad=True)
    v = torch.randn(B, H_kv, S, E, requires_grad=True)
    sinks = torch.randn(H_q, requires_grad=True)
    slopes = torch.tensor(alibi_slopes(H_q))
    mask = torch.rand(B, 1, L, S) > 0.2
    for kw in (dict(softcap=2.0), dict(softcap=3.0, window=5, alibi_slopes=slopes, sinks=sinks,
                                       attn_mask=mask, causal_align="bottom_right")):
        for x in (q, k, v, sinks):
            x.grad = None
        out = tmt.scaled_dot_product_attention(q, k, v, enable_gqa=True,
                                               is_causal="attn_mask" not in kw, **kw)
        g = torch.randn_like(out)
        out.backward(g)
        q64, k64, v64 = (x.detach().double().transpose(1, 2).requires_grad_() for x in (q, k, v))
        s64 = sinks.detach().double().requires_grad_() if "sinks" in kw else None
        ref, _ = ref_attention(q64, k64, v64, causal="attn_mask" not in kw,
                               align=kw.get("causal_align", "top_left"), softcap=kw["softcap"],
                               window=kw.get("window"),
                               alibi=slopes.double() if "alibi_slopes" in kw else None,
                               sinks=s64, mask=kw.get("attn_mask"))
        (ref * g.double().transpose(1, 2)).sum().backward()
        what = str(sorted(kw))
        assert_close(out.detach(), ref.detach().transpose(1, 2), FWD_ATOL, FWD_RTOL, what)
        assert_close(q.grad, q64.grad.transpose(1, 2), BWD_ATOL, BWD_RTOL, "dq " + what)
        assert_close(k.grad, k64.grad.transpose(1, 2), BWD_ATOL, BWD_RTOL, "dk " + what)
        assert_close(v.grad, v64.grad.transpose(1, 2), BWD_ATOL, BWD_RTOL, "dv " + what)
        if s64 is not None:
            assert_close(sinks.grad, s64.grad, BWD_ATOL, BWD_RTOL, "dsinks " + what)


def test_torch_mask_with_more_batch_dims_and_sinks_without_grad():
    q = torch.randn(2, 3, 4, 5, 8)  # two batch dimensions
    mask = torch.rand(3, 1, 5, 5) > 0.3
    mask[..., 0] = True
    out = tmt.scaled_dot_product_attention(q, q, q, attn_mask=mask)
    ref = F.scaled_dot_product_attention(q.double(), q.double(), q.double(), attn_mask=mask)
    assert_close(out, ref, FWD_ATOL, FWD_RTOL, "5-d")
    sinks = torch.zeros(4)  # no requires_grad: no gradient, and the others still flow
    x = q.clone().requires_grad_()
    tmt.scaled_dot_product_attention(x, x, x, sinks=sinks).sum().backward()
    assert x.grad is not None and sinks.grad is None


def test_torch_errors():
    q = torch.randn(1, 2, 4, 8)
    fn = "tokenmix.torch.scaled_dot_product_attention"
    mask = torch.ones(4, 4, dtype=torch.bool)
    with pytest.raises(RuntimeError):  # PyTorch refuses both too
        F.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=True)
    with pytest.raises(RuntimeError, match="attn_mask should not be set when is_causal"):
        tmt.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=True)
    grad_mask = torch.zeros(4, 4, requires_grad=True)
    with pytest.raises(tm.UnsupportedError, match=f"{fn}: attn_mask requires grad") as e:
        tmt.scaled_dot_product_attention(q, q, q, attn_mask=grad_mask)
    assert e.value.code == "unsupported"
    for bad, needle in ((torch.ones(4, 4, dtype=torch.int32), "bool or float32"),
                        (torch.ones(4, 4, dtype=torch.float64), "bool or float32"),
                        (torch.ones(5, 4, dtype=torch.bool), "does not broadcast"),
                        (torch.ones(2, 1, 1, 4, 4, dtype=torch.bool), "does not broadcast")):
        with pytest.raises(RuntimeError, match=needle):
            tmt.scaled_dot_product_attention(q, q, q, attn_mask=bad)
    with pytest.raises(TypeError, match="attn_mask must be a torch.Tensor"):
        tmt.scaled_dot_product_attention(q, q, q, attn_mask=[[True]])
    with pytest.raises(tm.ArgumentError, match="causal_align must be one of"):
        tmt.scaled_dot_product_attention(q, q, q, causal_align="bottom")
    with pytest.raises(tm.ArgumentError, match=r"sinks must have shape \(2,\)"):
        tmt.scaled_dot_product_attention(q, q, q, sinks=torch.zeros(3))
    with pytest.raises(NotImplementedError, match="sinks has dtype torch.float64"):
        tmt.scaled_dot_product_attention(q, q, q, sinks=torch.zeros(2, dtype=torch.float64))
    with pytest.raises(tm.UnsupportedError, match="alibi_slopes requires grad"):
        tmt.scaled_dot_product_attention(q, q, q, alibi_slopes=torch.ones(2, requires_grad=True))
    with pytest.raises(TypeError, match="window must be an int"):
        tmt.scaled_dot_product_attention(q, q, q, window=2.5)
    with pytest.raises(TypeError, match="window must be an int or None; got bool"):
        tmt.scaled_dot_product_attention(q, q, q, window=True)
    with pytest.raises(TypeError, match="softcap must be a real number"):
        tmt.scaled_dot_product_attention(q, q, q, softcap="1")
    with pytest.raises(tm.ArgumentError, match="window"):
        tmt.scaled_dot_product_attention(q, q, q, window=0)
    with pytest.raises(tm.ArgumentError, match="softcap"):
        tmt.scaled_dot_product_attention(q, q, q, softcap=-2.0)
    with pytest.raises(TypeError):  # keyword-only extras
        tmt.scaled_dot_product_attention(q, q, q, None, 0.0, False, None, False, 4)


# ---------------------------------------------------------------------------------------------
# PyTorch varlen_attention


@pytest.mark.parametrize("kw", [dict(), dict(window=4), dict(softcap=2.5, sinks=True),
                                dict(alibi=True), dict(is_causal=False, sinks=True)],
                         ids=["causal", "window", "softcap_sinks", "alibi", "noncausal_sinks"])
def test_torch_varlen_equals_per_sequence_sdpa(kw):
    """Packed sequences vs each sequence alone through SDPA (float64), bottom-right causal like
    FlashAttention ≥ 2.1, with gradients (sinks included)."""
    H_q, H_kv, E = 4, 2, 16
    lq, lk = [5, 1, 9, 4], [5, 6, 9, 2]
    kw = dict(kw)
    sinks = torch.randn(H_q, requires_grad=True) if kw.pop("sinks", False) else None
    slopes = torch.tensor(alibi_slopes(H_q)) if kw.pop("alibi", False) else None
    causal = kw.pop("is_causal", True)
    q = torch.randn(sum(lq), H_q, E, requires_grad=True)
    k = torch.randn(sum(lk), H_kv, E, requires_grad=True)
    v = torch.randn(sum(lk), H_kv, E, requires_grad=True)
    cq = torch.tensor(cu(lq), dtype=torch.int32)
    ck = torch.tensor(cu(lk), dtype=torch.int64)
    out = tmt.varlen_attention(q, k, v, cq, ck, max(lq), max(lk), is_causal=causal, sinks=sinks,
                               alibi_slopes=slopes, **kw)
    g = torch.randn_like(out)
    out.backward(g)
    s64 = None if sinks is None else sinks.detach().double().requires_grad_()
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    outs = []
    for i in range(len(lq)):
        qi = q64[cq[i]:cq[i + 1]][None]
        ki, vi = k64[ck[i]:ck[i + 1]][None], v64[ck[i]:ck[i + 1]][None]
        o, _ = ref_attention(qi, ki, vi, causal=causal, align="bottom_right", sinks=s64,
                             window=kw.get("window"), softcap=kw.get("softcap"),
                             alibi=None if slopes is None else slopes.double())
        outs.append(o[0])
    ref = torch.cat(outs)
    (ref * g.double()).sum().backward()
    assert_close(out.detach(), ref.detach(), FWD_ATOL, FWD_RTOL, "out")
    assert_close(q.grad, q64.grad, BWD_ATOL, BWD_RTOL, "dq")
    assert_close(k.grad, k64.grad, BWD_ATOL, BWD_RTOL, "dk")
    assert_close(v.grad, v64.grad, BWD_ATOL, BWD_RTOL, "dv")
    if sinks is not None:
        assert_close(sinks.grad, s64.grad, BWD_ATOL, BWD_RTOL, "dsinks")
    if not kw and slopes is None and sinks is None:  # plain causal: PyTorch's own SDPA too
        for i in range(len(lq)):
            a, b = lq[i], lk[i]
            m = torch.arange(b)[None, :] <= torch.arange(a)[:, None] + (b - a)
            r = F.scaled_dot_product_attention(
                q64[cq[i]:cq[i + 1]].detach().transpose(0, 1)[None],
                k64[ck[i]:ck[i + 1]].detach().transpose(0, 1)[None],
                v64[ck[i]:ck[i + 1]].detach().transpose(0, 1)[None], attn_mask=m,
                enable_gqa=True)
            assert_close(out.detach()[cq[i]:cq[i + 1]], r[0].transpose(0, 1), FWD_ATOL, FWD_RTOL,
                         f"sdpa seq {i}")


def test_torch_varlen_errors():
    q = torch.randn(8, 2, 4)
    fn = "tokenmix.torch.varlen_attention"
    good = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(tm.ArgumentError, match=f"{fn}: max_seqlen_q is 4 but sequence 1 has 5"):
        tmt.varlen_attention(q, q, q, good, good, 4, 5)
    with pytest.raises(tm.ArgumentError, match=r"cu_seqlens_q.*\b1\b"):
        tmt.varlen_attention(q, q, q, torch.tensor([0, 9, 8], dtype=torch.int32), good, 9, 5)
    with pytest.raises(TypeError, match="cu_seqlens_k has dtype float32"):
        tmt.varlen_attention(q, q, q, good, good.float(), 5, 5)
    with pytest.raises(tm.ArgumentError, match="q must have 3 dimensions"):
        tmt.varlen_attention(q[None], q, q, good, good, 5, 5)
    with pytest.raises(NotImplementedError, match="k has dtype torch.float64"):
        tmt.varlen_attention(q, q.double(), q, good, good, 5, 5)
    with pytest.raises(TypeError, match="max_seqlen_k must be an int"):
        tmt.varlen_attention(q, q, q, good, good, 5, 5.0)
    with pytest.raises(tm.ArgumentError, match="sinks must have shape"):
        tmt.varlen_attention(q, q, q, good, good, 5, 5, sinks=torch.zeros(3))


# ---------------------------------------------------------------------------------------------
# Decode on the KV cache (NumPy API): the same variants, rolling caches


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("kw", [dict(window=5), dict(softcap=2.0), dict(alibi=True),
                                dict(sinks=True), dict(window=3, softcap=4.0, alibi=True,
                                                       sinks=True)],
                         ids=["window", "softcap", "alibi", "sinks", "all"])
def test_decode_variants_equal_attention_forward(kw, isa):
    """T_new = 3 new queries per sequence against a cache of 20 (sequence 0) and 9 positions:
    what attention_forward (bottom-right, checked against the float64 reference above) gives on
    the same keys, with the same variants."""
    H_q, H_kv, D = 4, 2, 16
    kw = dict(kw)
    if kw.pop("alibi", False):
        kw["alibi_slopes"] = alibi_slopes(H_q)
    if kw.pop("sinks", False):
        kw["sinks"] = rand(H_q)
    lengths = [20, 9]
    cache = tm.KVCache(1, 2, H_kv, D, 64)
    keys = [rand(1, n, H_kv, D) for n in lengths]
    vals = [rand(1, n, H_kv, D) for n in lengths]
    for b in range(2):
        cache.append(0, keys[b], vals[b], first_seq=b)
    q = rand(2, 3, H_q, D)
    out, lse = tm.attention_decode(q, cache, 0, return_lse=True, isa=isa, **kw)
    for b in range(2):
        ref, rlse = tm.attention_forward(q[b:b + 1], keys[b], vals[b], return_lse=True,
                                         isa="portable", **kw)
        assert_close(out[b:b + 1], ref, 1e-5, 1e-5, f"out seq {b}")
        assert_lse_close(lse[b:b + 1], rlse, f"lse seq {b}")


def test_decode_rolling_cache_equals_full_cache_and_errors():
    """A sliding-window layer's rolling cache (KVCache(window=W)) keeps O(W) positions and gives
    what the full cache gives with window=W; a decode window wider than the ring is refused."""
    H_q, H_kv, D, W = 2, 1, 8, 6
    full = tm.KVCache(1, 1, H_kv, D, 512)
    ring = tm.KVCache(1, 1, H_kv, D, 512, window=W)
    assert ring.window == W and ring.retained_positions < 512
    assert ring.storage_bytes < full.storage_bytes
    for step in range(5):
        k, v = rand(1, 40, H_kv, D), rand(1, 40, H_kv, D)
        full.append(0, k, v)
        ring.append(0, k, v)
        q = rand(1, 1, H_q, D)
        a = tm.attention_decode(q, full, 0, window=W, sinks=[0.5, -0.5])
        b = tm.attention_decode(q, ring, 0, window=W, sinks=[0.5, -0.5])
        assert np.array_equal(a, b), step
    assert ring.first_position(0) > 0 and full.first_position(0) == 0
    assert ring.decode_bytes(0, 0, 1, window=W) == full.decode_bytes(0, 0, 1, window=W)
    assert full.decode_bytes(0, 0, 1, window=W) < full.decode_bytes(0, 0, 1)
    q = rand(1, 1, H_q, D)
    with pytest.raises(tm.ArgumentError, match="window"):
        tm.attention_decode(q, ring, 0)  # a rolling cache needs the window
    with pytest.raises(tm.ArgumentError, match="window"):
        tm.attention_decode(q, ring, 0, window=W + 500)
    with pytest.raises(tm.ArgumentError, match="window"):
        tm.attention_decode(q, full, 0, window=0)
    with pytest.raises(TypeError, match="attention_decode: sinks has dtype float64"):
        tm.attention_decode(q, full, 0, sinks=np.zeros(2))
    with pytest.raises(tm.ArgumentError, match="alibi_slopes"):
        tm.attention_decode(q, full, 0, alibi_slopes=np.zeros(3, np.float32))


def test_windowed_useful_work_counts():
    """pairs(t), P and the FLOPs with a window count exactly the keys visibility() leaves."""
    cases = [(9, 9, True, "bottom_right", 3), (5, 12, True, "top_left", 4),
             (12, 5, True, "bottom_right", 2), (7, 7, False, "top_left", 2),
             (6, 6, True, "bottom_right", 100)]
    for T_q, T_k, causal, align, W in cases:
        vis = visibility(1, 1, T_q, T_k, causal=causal, align=align, window=W)[0, 0]
        for t in range(T_q):
            assert tm.visible_keys(t, T_q, T_k, causal, align, window=W) == int(vis[t].sum())
        P = int(vis.sum())
        assert tm.visible_pairs(T_q, T_k, causal, align, window=W) == P
        assert tm.forward_flops(2, T_q, T_k, 3, 8, causal, align, window=W) == 4.0 * 8 * 3 * P * 2
        assert tm.backward_flops(2, T_q, T_k, 3, 8, causal, align, window=W) == \
            2.5 * 4.0 * 8 * 3 * P * 2
    assert tm.visible_pairs(10, 10, window=1) == 10
    with pytest.raises(tm.ArgumentError, match="window"):
        tm.visible_pairs(4, 4, window=0)
    with pytest.raises(TypeError, match="forward_flops: window must be an integer"):
        tm.forward_flops(1, 4, 4, 1, 8, window=2.5)


# ---------------------------------------------------------------------------------------------
# The layer (CausalSelfAttention) with variants


def test_layer_variants_forward_backward_and_decode():
    """A layer with window, softcap, ALiBi and sinks: its attention core equals the float64
    reference on the layer's own (post-RoPE) q, k, v; d(sinks) equals autograd of that reference
    through W_O; prefill + steps on a rolling cache equal the forward."""
    d, H_q, H_kv, D, B, T, W = 32, 4, 2, 8, 2, 13, 5
    slopes, sinks = alibi_slopes(H_q), rand(H_q)
    layer = tm.CausalSelfAttention(d, H_q, H_kv, D, rope="rotate_half", seed=5, window=W,
                                   softcap=4.0, alibi_slopes=slopes, sinks=sinks)
    assert layer.window == W and layer.softcap == 4.0
    slopes[:] = 0.0  # the layer holds its own copies
    sinks_ref = sinks.copy()
    sinks[:] = 0.0
    u = rand(B, T, d)
    d_out = rand(B, T, d)
    out = layer.forward(u)
    grads = layer.backward(d_out)
    saved = layer.saved()
    s64 = t64(sinks_ref).requires_grad_()
    y, _ = ref_attention(t64(saved["q"]), t64(saved["k"]), t64(saved["v"]), window=W,
                         softcap=4.0, alibi=t64(alibi_slopes(H_q)), sinks=s64)
    assert_close(saved["y"], y.detach(), FWD_ATOL, FWD_RTOL, "layer attention core")
    o = y.reshape(B, T, H_q * D) @ t64(layer.w_o)
    assert_close(out, o.detach(), 3e-5, 1e-4, "layer out")
    (o * t64(d_out)).sum().backward()
    assert grads.d_sinks.shape == (H_q,)
    assert_close(grads.d_sinks, s64.grad, BWD_ATOL, BWD_RTOL, "layer d_sinks")

    cache = tm.KVCache(1, B, H_kv, D, 256, window=W)
    outs = [layer.prefill(np.ascontiguousarray(u[:, :7]), cache, 0)]
    for t in range(7, T):
        outs.append(layer.step(np.ascontiguousarray(u[:, t]), cache, 0)[:, None])
    assert_close(np.concatenate(outs, 1), out, 1e-5, 1e-5, "prefill + steps on a rolling cache")

    plain = tm.CausalSelfAttention(d, H_q, H_kv, D, seed=5)
    plain.forward(u)
    assert plain.backward(d_out).d_sinks is None and plain.window is None
    with pytest.raises(tm.ArgumentError, match="CausalSelfAttention.*window"):
        tm.CausalSelfAttention(d, H_q, H_kv, D, window=0)
    with pytest.raises(tm.ArgumentError, match="sinks"):
        tm.CausalSelfAttention(d, H_q, H_kv, D, sinks=np.zeros(3, np.float32))
    with pytest.raises(TypeError, match="CausalSelfAttention: alibi_slopes has dtype float64"):
        tm.CausalSelfAttention(d, H_q, H_kv, D, alibi_slopes=np.zeros(H_q))
