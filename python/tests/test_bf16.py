"""bfloat16 and float16 attention (SPEC "Reduced precision", issue 13) through the Python APIs.

Accuracy yardstick (SPEC "Reduced precision"): the float64 oracle run on the *same, already
rounded* inputs — the bf16/f16 q, k, v and upstream gradient widened exactly to float64 — against
which tokenmix's O, dQ, dK, dV must be no less accurate than PyTorch's CPU SDPA run in the same
dtype on the same inputs. Error measures, both per tensor:

* the root-mean-square error ‖x − ref‖ / sqrt(n): must be ≤ PyTorch's;
* the largest element error max |x − ref|: must be ≤ PyTorch's plus one unit in the last place
  of the dtype at max |ref| (both results are rounded to the dtype once at least, so the largest
  error is set by one element's final rounding, whose direction is arbitrary; one ulp lets
  neither side be charged for it, and anything a lower-precision intermediate costs is larger).

The float64 oracle is the SPEC's equations (4.2–4.5, "Backward pass") written with torch ops over
blocks of query rows (no T×T buffer for T = 8192), keys beyond the causal frontier skipped.
"""

from __future__ import annotations

import copy
import math
from typing import Optional, Tuple

import ml_dtypes
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tokenmix as tm
import tokenmix.torch as tmt

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16}
NP_DTYPES = {"bf16": np.dtype(ml_dtypes.bfloat16), "f16": np.dtype(np.float16)}
MANTISSA_BITS = {torch.bfloat16: 7, torch.float16: 10}


# --- the float64 oracle ---------------------------------------------------------------------


def oracle(q, k, v, dout, causal: bool, bias: Optional[torch.Tensor] = None,
           scale: Optional[float] = None, rows: int = 1024):
    """O, dQ, dK, dV in float64 for [B, H, T, D] inputs (float64), GQA by j(h) = h // g (4.8).

    S = s·Q Kᵀ + bias (4.2), causal top-left (key u visible to query t iff u ≤ t, 4.3),
    A = softmax(S) (4.4), O = A V (4.5); backward: dV = Aᵀ dO, dA = dO Vᵀ,
    dS = A ⊙ (dA − rowsum(dO ⊙ O)), dQ = s·dS K, dK = s·dSᵀ Q (SPEC "Backward pass")."""
    B, H, T_q, D = q.shape
    H_kv, T_k = k.shape[1], k.shape[2]
    g = H // H_kv
    s = 1.0 / math.sqrt(D) if scale is None else scale
    ke, ve = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    out, dq = torch.empty_like(q), torch.empty_like(q)
    dke, dve = torch.zeros_like(ke), torch.zeros_like(ve)
    for a in range(0, T_q, rows):
        b = min(T_q, a + rows)
        n = min(T_k, b) if causal else T_k  # keys past the block's last row are all masked
        kb, vb = ke[:, :, :n], ve[:, :, :n]
        S = s * (q[:, :, a:b] @ kb.transpose(-1, -2))
        if bias is not None:
            S = S + bias[..., a:b, :n]
        if causal:
            t = torch.arange(a, b).unsqueeze(1)
            u = torch.arange(n).unsqueeze(0)
            S = S.masked_fill(u > t, float("-inf"))
        A = torch.softmax(S, dim=-1)
        O = A @ vb
        out[:, :, a:b] = O
        do = dout[:, :, a:b]
        dve[:, :, :n] += A.transpose(-1, -2) @ do
        dS = A * (do @ vb.transpose(-1, -2) - (do * O).sum(-1, keepdim=True))
        dq[:, :, a:b] = s * (dS @ kb)
        dke[:, :, :n] += s * (dS.transpose(-1, -2) @ q[:, :, a:b])
    dk = dke.view(B, H_kv, g, T_k, D).sum(2)
    dv = dve.view(B, H_kv, g, T_k, D).sum(2)
    return out, dq, dk, dv


def forward_backward(sdpa, q, k, v, dout, **kw) -> Tuple[torch.Tensor, ...]:
    """(O, dQ, dK, dV) of sdpa(q, k, v, **kw) with upstream gradient dout."""
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = sdpa(q, k, v, **kw)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def ulp(dtype: torch.dtype, magnitude: float) -> float:
    """One unit in the last place of `dtype` for numbers of this magnitude."""
    if magnitude == 0.0:
        return 0.0
    return 2.0 ** (math.floor(math.log2(magnitude)) - MANTISSA_BITS[dtype])


def errors(x: torch.Tensor, ref: torch.Tensor) -> Tuple[float, float]:
    d = x.double() - ref
    return d.abs().max().item(), d.pow(2).mean().sqrt().item()


def assert_no_worse_than_torch(ours, theirs, ref, dtype, what: str) -> None:
    for name, o, t, r in zip(("O", "dQ", "dK", "dV"), ours, theirs, ref):
        assert o.dtype == dtype, (what, name, o.dtype)
        assert torch.isfinite(o).all(), (what, name)
        max_o, rms_o = errors(o, r)
        max_t, rms_t = errors(t, r)
        assert rms_o <= rms_t, f"{what} {name}: rms error {rms_o:.3e} > PyTorch's {rms_t:.3e}"
        slack = ulp(dtype, r.abs().max().item())
        assert max_o <= max_t + slack, (
            f"{what} {name}: max error {max_o:.3e} > PyTorch's {max_t:.3e} + 1 ulp {slack:.1e}")


def rounded(shape, dtype, scale: float = 1.0) -> torch.Tensor:
    """Unit-normal draws rounded to `dtype` (the inputs both sides and the oracle share)."""
    return (scale * torch.randn(shape)).to(dtype)


# --- accuracy against PyTorch's SDPA in the same dtype --------------------------------------

# (T, H_q, H_kv, d_h, causal): tile-edge and odd sizes, GQA and MHA, causal and not, then long
# sequences with few heads and a small head width (runtime).
SHAPES = [
    (1, 2, 1, 8, True),
    (77, 4, 2, 64, True),
    (130, 4, 4, 80, False),
    (257, 6, 2, 128, True),
    (2048, 2, 1, 32, True),
    (2048, 2, 2, 32, False),
]


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("T,H_q,H_kv,D,causal", SHAPES)
def test_accuracy_no_worse_than_torch_sdpa(dt, T, H_q, H_kv, D, causal):
    dtype = DTYPES[dt]
    q, k, v = rounded((1, H_q, T, D), dtype), rounded((1, H_kv, T, D), dtype), \
        rounded((1, H_kv, T, D), dtype)
    dout = rounded((1, H_q, T, D), dtype)
    kw = dict(is_causal=causal, enable_gqa=True)
    ours = forward_backward(tmt.scaled_dot_product_attention, q, k, v, dout, **kw)
    theirs = forward_backward(F.scaled_dot_product_attention, q, k, v, dout, **kw)
    ref = oracle(q.double(), k.double(), v.double(), dout.double(), causal)
    assert_no_worse_than_torch(ours, theirs, ref, dtype, f"{dt} T={T}")


@pytest.mark.slow  # T = 8192 against float64, ~8 s; the 2048-long cases above run everyday
def test_accuracy_at_8192_bf16_causal_gqa():
    """The long end of the issue's range: T = 8192, causal, GQA (2 query heads on 1 KV head)."""
    dtype, T = torch.bfloat16, 8192
    q, k, v = rounded((1, 2, T, 16), dtype), rounded((1, 1, T, 16), dtype), \
        rounded((1, 1, T, 16), dtype)
    dout = rounded((1, 2, T, 16), dtype)
    kw = dict(is_causal=True, enable_gqa=True)
    ours = forward_backward(tmt.scaled_dot_product_attention, q, k, v, dout, **kw)
    theirs = forward_backward(F.scaled_dot_product_attention, q, k, v, dout, **kw)
    ref = oracle(q.double(), k.double(), v.double(), dout.double(), True)
    assert_no_worse_than_torch(ours, theirs, ref, dtype, "bf16 T=8192")


def test_accuracy_at_4096_f16_noncausal_gqa():
    dtype, T = torch.float16, 4096
    q, k, v = rounded((1, 2, T, 16), dtype), rounded((1, 1, T, 16), dtype), \
        rounded((1, 1, T, 16), dtype)
    dout = rounded((1, 2, T, 16), dtype)
    kw = dict(is_causal=False, enable_gqa=True)
    ours = forward_backward(tmt.scaled_dot_product_attention, q, k, v, dout, **kw)
    theirs = forward_backward(F.scaled_dot_product_attention, q, k, v, dout, **kw)
    ref = oracle(q.double(), k.double(), v.double(), dout.double(), False)
    assert_no_worse_than_torch(ours, theirs, ref, dtype, "f16 T=4096")


def to_numpy(x: torch.Tensor) -> np.ndarray:
    """A bf16/f16 tensor as a NumPy array of the same bits (ml_dtypes.bfloat16 / float16)."""
    if x.dtype == torch.bfloat16:
        return x.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return x.numpy()


def from_numpy(x: np.ndarray) -> torch.Tensor:
    if x.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("isa", tm.available_isas())
@pytest.mark.parametrize("T,D,causal", [(520, 64, True), (301, 40, False)])
def test_accuracy_every_kernel_path(dt, isa, T, D, causal):
    """Every kernel path this CPU has (``isa=``, NumPy API on ml_dtypes.bfloat16 / float16
    arrays in PyTorch's [B, H, T, d_h] layout) is no less accurate than PyTorch's SDPA."""
    dtype, H_q, H_kv = DTYPES[dt], 4, 2
    q, k, v = rounded((1, H_q, T, D), dtype), rounded((1, H_kv, T, D), dtype), \
        rounded((1, H_kv, T, D), dtype)
    dout = rounded((1, H_q, T, D), dtype)
    kw = dict(causal=causal, layout="bhtd", isa=isa, align="top_left")
    out, lse = tm.attention_forward(*(to_numpy(x) for x in (q, k, v)), return_lse=True, **kw)
    grads = tm.attention_backward(*(to_numpy(x) for x in (q, k, v)), out, lse, to_numpy(dout),
                                  **kw)
    ours = tuple(from_numpy(x) for x in (out,) + tuple(grads))
    theirs = forward_backward(F.scaled_dot_product_attention, q, k, v, dout, is_causal=causal,
                              enable_gqa=True)
    ref = oracle(q.double(), k.double(), v.double(), dout.double(), causal)
    assert_no_worse_than_torch(ours, theirs, ref, dtype, f"{dt} {isa} T={T}")


@pytest.mark.parametrize("dt", list(DTYPES))
def test_accuracy_window_and_alibi_variants(dt):
    """Score variants in reduced precision: tokenmix's window= and alibi_slopes= against PyTorch
    given the same scores as an explicit mask (bool for the window; a float32 bias for ALiBi,
    which PyTorch accepts with bf16/f16 queries; the slopes are powers of two, so the bias is
    exact in float32)."""
    dtype, T, H, D, W = DTYPES[dt], 300, 4, 64, 37
    q, k, v = rounded((1, H, T, D), dtype), rounded((1, 2, T, D), dtype), \
        rounded((1, 2, T, D), dtype)
    dout = rounded((1, H, T, D), dtype)
    t = torch.arange(T).unsqueeze(1)
    u = torch.arange(T).unsqueeze(0)
    # window W, causal: visible iff t − W < u ≤ t
    visible = (u <= t) & (u > t - W)
    ours = forward_backward(tmt.scaled_dot_product_attention, q, k, v, dout, is_causal=True,
                            enable_gqa=True, window=W)
    theirs = forward_backward(F.scaled_dot_product_attention, q, k, v, dout,
                              attn_mask=visible, enable_gqa=True)
    bias = torch.zeros(T, T, dtype=torch.float64).masked_fill(~visible, float("-inf"))
    ref = oracle(q.double(), k.double(), v.double(), dout.double(), False, bias=bias)
    assert_no_worse_than_torch(ours, theirs, ref, dtype, f"{dt} window")

    slopes = torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=torch.float32)
    alibi = (-slopes.view(H, 1, 1) * (t - u).to(torch.float32)).masked_fill(u > t, float("-inf"))
    ours = forward_backward(tmt.scaled_dot_product_attention, q, k, v, dout, is_causal=True,
                            enable_gqa=True, alibi_slopes=slopes)
    theirs = forward_backward(F.scaled_dot_product_attention, q, k, v, dout,
                              attn_mask=alibi.unsqueeze(0), enable_gqa=True)
    ref = oracle(q.double(), k.double(), v.double(), dout.double(), False,
                 bias=alibi.double().unsqueeze(0))
    assert_no_worse_than_torch(ours, theirs, ref, dtype, f"{dt} alibi")


@pytest.mark.parametrize("dt", list(DTYPES))
def test_masks_in_reduced_precision(dt):
    """attn_mask as PyTorch takes it with bf16/f16 queries: bool, float32, or the query's dtype
    (widened exactly to float32 here: the same result as the float32 mask of the same values)."""
    dtype, T, D = DTYPES[dt], 40, 32
    q, k, v = rounded((2, 2, T, D), dtype), rounded((2, 2, T, D), dtype), \
        rounded((2, 2, T, D), dtype)
    keep = torch.rand(T, T) > 0.3
    keep[:, 0] = True
    bias = torch.randn(2, 1, T, T).to(dtype).masked_fill(~keep, float("-inf"))
    out_low = tmt.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    out_f32 = tmt.scaled_dot_product_attention(q, k, v, attn_mask=bias.float())
    assert out_low.dtype == dtype and torch.equal(out_low, out_f32)
    ref = oracle(q.double(), k.double(), v.double(), torch.zeros(2, 2, T, D, dtype=torch.float64),
                 False, bias=bias.double())[0]
    theirs = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
    assert errors(out_low, ref)[1] <= errors(theirs, ref)[1]
    out_bool = tmt.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    ref_bool = oracle(q.double(), k.double(), v.double(), torch.zeros_like(ref), False,
                      bias=torch.zeros(T, T, dtype=torch.float64).masked_fill(~keep, -math.inf))[0]
    assert errors(out_bool, ref_bool)[1] <= errors(F.scaled_dot_product_attention(
        q, k, v, attn_mask=keep), ref_bool)[1]


@pytest.mark.parametrize("dt", list(DTYPES))
def test_sinks_gradient_in_reduced_precision(dt):
    """sinks stay float32 (a bf16/f16 sinks tensor is widened exactly and gets its gradient in
    its own dtype through the widening); O and the gradients come in the inputs' dtype and are
    close to the float32 path's on the same rounded inputs."""
    dtype, T, H, D = DTYPES[dt], 50, 2, 16
    q, k, v = rounded((1, H, T, D), dtype), rounded((1, H, T, D), dtype), \
        rounded((1, H, T, D), dtype)
    dout = rounded((1, H, T, D), dtype)
    sinks32 = torch.tensor([0.5, -1.0], requires_grad=True)
    sinks_low = torch.tensor([0.5, -1.0], dtype=dtype, requires_grad=True)
    out32 = tmt.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                             sinks=sinks32)
    out32.backward(dout.float())
    out = tmt.scaled_dot_product_attention(q, k, v, is_causal=True, sinks=sinks_low)
    out.backward(dout)
    assert out.dtype == dtype and sinks_low.grad.dtype == dtype
    tol = 4 * 2.0 ** -MANTISSA_BITS[dtype]
    assert (out.float() - out32).abs().max().item() <= tol * out32.abs().max().item()
    assert (sinks_low.grad.float() - sinks32.grad).abs().max().item() <= \
        tol * sinks32.grad.abs().max().item() + 1e-6


# --- dtypes of results, gradients, autocast --------------------------------------------------


@pytest.mark.parametrize("dt", list(DTYPES))
def test_outputs_and_gradients_in_input_dtype(dt):
    dtype = DTYPES[dt]
    q = rounded((2, 4, 33, 24), dtype).requires_grad_()
    k = rounded((2, 2, 33, 24), dtype).requires_grad_()
    v = rounded((2, 2, 33, 24), dtype).requires_grad_()
    out = tmt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.dtype == dtype and out.shape == (2, 4, 33, 24)
    out.float().square().sum().backward()
    for t in (q, k, v):
        assert t.grad.dtype == dtype and t.grad.shape == t.shape
        assert torch.isfinite(t.grad).all()


@pytest.mark.parametrize("dt", list(DTYPES))
def test_results_do_not_depend_on_strides(dt):
    """[B, T, H, D] projections seen as [B, H, T, D] (PyTorch's SDPA layout) without a copy give
    the same bits as contiguous inputs."""
    dtype = DTYPES[dt]
    x = rounded((1, 45, 3, 4, 32), dtype)  # [B, T, (q, k, v), H, D]
    q, k, v = (x[:, :, i].transpose(1, 2) for i in range(3))
    assert not q.is_contiguous()
    a = tmt.scaled_dot_product_attention(q, k, v, is_causal=True)
    b = tmt.scaled_dot_product_attention(q.contiguous(), k.contiguous(), v.contiguous(),
                                         is_causal=True)
    assert torch.equal(a, b)


@pytest.mark.parametrize("autocast_dtype", [torch.bfloat16, torch.float16])
def test_autocast_cpu_runs_in_the_autocast_dtype(autocast_dtype):
    """Under torch.autocast("cpu"), float32 inputs run in the autocast dtype as PyTorch's SDPA
    does there (a lower-precision op on CPU): the output has that dtype, equals the call on
    inputs cast by hand, and float32 leaves get float32 gradients through the casts."""
    q = torch.randn(1, 4, 37, 32, requires_grad=True)
    k = torch.randn(1, 2, 37, 32, requires_grad=True)
    v = torch.randn(1, 2, 37, 32, requires_grad=True)
    dout = torch.randn(1, 4, 37, 32).to(autocast_dtype)
    with torch.autocast("cpu", dtype=autocast_dtype):
        out = tmt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.dtype == theirs.dtype == autocast_dtype
    out.backward(dout)
    assert q.grad.dtype == k.grad.dtype == v.grad.dtype == torch.float32
    ql, kl, vl = (t.detach().to(autocast_dtype).requires_grad_() for t in (q, k, v))
    manual = tmt.scaled_dot_product_attention(ql, kl, vl, is_causal=True, enable_gqa=True)
    manual.backward(dout)
    assert torch.equal(out, manual)
    for auto, man in ((q, ql), (k, kl), (v, vl)):
        assert torch.equal(auto.grad, man.grad.float())
    # Inputs already in a reduced dtype are cast to the autocast dtype as well; float64 is left
    # alone by autocast (as for PyTorch's SDPA) and then refused as unsupported.
    other = torch.float16 if autocast_dtype == torch.bfloat16 else torch.bfloat16
    with torch.autocast("cpu", dtype=autocast_dtype):
        assert tmt.scaled_dot_product_attention(q.to(other), k.to(other), v.to(other),
                                                enable_gqa=True).dtype == autocast_dtype
        with pytest.raises(NotImplementedError, match="query has dtype torch.float64"):
            tmt.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                             enable_gqa=True)
    # Outside autocast float32 stays float32.
    assert tmt.scaled_dot_product_attention(q, k, v, enable_gqa=True).dtype == torch.float32


def test_autocast_varlen():
    q, k, v = torch.randn(20, 4, 16), torch.randn(20, 2, 16), torch.randn(20, 2, 16)
    cu = torch.tensor([0, 7, 20], dtype=torch.int32)
    with torch.autocast("cpu"):
        out = tmt.varlen_attention(q, k, v, cu, cu, 13, 13)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, tmt.varlen_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), cu,
                                                 cu, 13, 13))


@pytest.mark.parametrize("dt", list(DTYPES))
def test_varlen_reduced_precision_matches_oracle(dt):
    """Packed varlen batch in bf16/f16: per sequence, O and the gradients agree with the float64
    oracle to the dtype's rounding (fp32 accumulation, one rounding at the end)."""
    dtype, H_q, H_kv, D = DTYPES[dt], 4, 2, 32
    lens = [5, 64, 1, 100]
    cu = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int64)
    total = int(cu[-1])
    q, k, v = rounded((total, H_q, D), dtype), rounded((total, H_kv, D), dtype), \
        rounded((total, H_kv, D), dtype)
    dout = rounded((total, H_q, D), dtype)
    got = forward_backward(
        lambda a, b, c: tmt.varlen_attention(a, b, c, cu, cu, max(lens), max(lens)),
        q, k, v, dout)
    for x in got:
        assert x.dtype == dtype
    for i, n in enumerate(lens):
        s = slice(int(cu[i]), int(cu[i + 1]))
        seq = [x[s].permute(1, 0, 2).unsqueeze(0).double() for x in (q, k, v, dout)]
        ref = oracle(*seq, causal=True)
        for name, x, r in zip(("O", "dQ", "dK", "dV"), got, ref):
            x = x[s].permute(1, 0, 2).unsqueeze(0)
            bound = 2.0 ** -MANTISSA_BITS[dtype] * (r.abs().max().item() + 1.0)
            assert errors(x, r)[0] <= bound, (dt, i, name)


# --- the NumPy API with ml_dtypes.bfloat16 and float16 arrays --------------------------------


@pytest.mark.parametrize("dt", list(DTYPES))
def test_numpy_api_reduced_precision(dt):
    """ml_dtypes.bfloat16 / float16 NumPy arrays: outputs in that dtype (lse float32), the same
    bits as the PyTorch drop-in on the same values, strided views taken without a copy, and
    caller-supplied outputs written in place."""
    dtype, npdt = DTYPES[dt], NP_DTYPES[dt]
    rng = np.random.default_rng(3)
    B, T, H_q, H_kv, D = 2, 70, 4, 2, 40
    q = rng.standard_normal((B, T, H_q, D)).astype(np.float32).astype(npdt)
    k = rng.standard_normal((B, T, H_kv, D)).astype(np.float32).astype(npdt)
    v = rng.standard_normal((B, T, H_kv, D)).astype(np.float32).astype(npdt)
    dout = rng.standard_normal((B, T, H_q, D)).astype(np.float32).astype(npdt)
    out, lse = tm.attention_forward(q, k, v, return_lse=True)
    assert out.dtype == npdt and lse.dtype == np.float32 and lse.shape == (B, H_q, T)
    dq, dk, dv = tm.attention_backward(q, k, v, out, lse, dout)
    assert dq.dtype == dk.dtype == dv.dtype == npdt

    def t(x):  # the same values as a torch tensor in [B, H, T, D]
        return torch.from_numpy(x.astype(np.float32)).to(dtype).permute(0, 2, 1, 3)

    ours = forward_backward(tmt.scaled_dot_product_attention, t(q), t(k), t(v), t(dout),
                            is_causal=True, enable_gqa=True)
    for x, y in zip((out, dq, dk, dv), ours):
        assert np.array_equal(x.view(np.uint16), y.permute(0, 2, 1, 3).contiguous()
                              .view(torch.int16).numpy().view(np.uint16))
    ref = oracle(*(t(x).double() for x in (q, k, v, dout)), causal=True)
    for x, r in zip((out, dq, dk, dv), ref):
        x = torch.from_numpy(x.astype(np.float32)).permute(0, 2, 1, 3)
        assert errors(x, r)[0] <= 2.0 ** -MANTISSA_BITS[dtype] * (r.abs().max().item() + 1.0)

    # Strided views (every other head, a transposed layout) and outputs in place (poisoned).
    wide = rng.standard_normal((B, H_q, T, 2 * D)).astype(np.float32).astype(npdt)
    qs = wide[..., ::2]  # [B, H, T, D], stride 2 along D
    assert not qs.flags.c_contiguous
    kk, vv = np.ascontiguousarray(k.transpose(0, 2, 1, 3)), np.ascontiguousarray(
        v.transpose(0, 2, 1, 3))
    dest = np.full((B, H_q, T, D), np.nan, dtype=npdt)
    res = tm.attention_forward(qs, kk, vv, out=dest, layout="bhtd")
    assert res is dest and not np.isnan(dest.astype(np.float32)).any()
    again = tm.attention_forward(np.ascontiguousarray(qs), kk, vv, layout="bhtd")
    assert np.array_equal(dest.view(np.uint16), again.view(np.uint16))


@pytest.mark.parametrize("dt", list(DTYPES))
@pytest.mark.parametrize("cache_dtype", ["f32", "bf16", "f16"])
def test_decode_reduced_precision_queries(dt, cache_dtype):
    """bf16/f16 queries against a KV cache of any dtype: out in the queries' dtype, equal to the
    float32 queries' result up to the final rounding of out and of q itself."""
    npdt = NP_DTYPES[dt]
    rng = np.random.default_rng(5)
    B, T, H_q, H_kv, D = 2, 50, 4, 2, 32
    cache = tm.KVCache(1, B, H_kv, D, 64, dtype=cache_dtype)
    k = rng.standard_normal((B, T, H_kv, D)).astype(np.float32)
    v = rng.standard_normal((B, T, H_kv, D)).astype(np.float32)
    cache.append(0, k, v)
    q = rng.standard_normal((B, 1, H_q, D)).astype(np.float32).astype(npdt)
    out, lse = tm.attention_decode(q, cache, 0, return_lse=True)
    assert out.dtype == npdt and lse.dtype == np.float32
    ref = tm.attention_decode(q.astype(np.float32), cache, 0)
    tol = 2.0 ** -MANTISSA_BITS[DTYPES[dt]] * (np.abs(ref).max() + 1.0)
    assert np.abs(out.astype(np.float32) - ref).max() <= tol
    # The same queries as a torch tensor: out a tensor of that dtype, the same bits.
    qt = from_numpy(q)
    out_t = tm.attention_decode(qt, cache, 0)
    assert out_t.dtype == DTYPES[dt] and torch.equal(out_t, from_numpy(out))


# --- dtype errors ---------------------------------------------------------------------------


def test_numpy_dtype_errors():
    bf = np.zeros((1, 8, 2, 16), dtype=ml_dtypes.bfloat16)
    f16 = np.zeros((1, 8, 2, 16), dtype=np.float16)
    f32 = np.zeros((1, 8, 2, 16), dtype=np.float32)
    with pytest.raises(TypeError, match=r"^attention_forward: k has dtype float16 but q has "
                                        r"bfloat16; q, k, v and out must have one dtype"):
        tm.attention_forward(bf, f16, bf)
    with pytest.raises(TypeError, match=r"^attention_forward: v has dtype float32 but q has "
                                        r"bfloat16"):
        tm.attention_forward(bf, bf, f32)
    with pytest.raises(TypeError, match=r"^attention_forward: out has dtype float32 but q has "
                                        r"float16"):
        tm.attention_forward(f16, f16, f16, out=np.zeros_like(f32))
    with pytest.raises(TypeError, match=r"^attention_forward: lse has dtype bfloat16; tokenmix "
                                        r"computes in float32 only"):
        tm.attention_forward(bf, bf, bf, lse=np.zeros((1, 2, 8), dtype=ml_dtypes.bfloat16))
    with pytest.raises(TypeError, match=r"^attention_forward: q has dtype float8_e4m3fn; "
                                        r"expected float32, bfloat16"):
        tm.attention_forward(f32.astype(ml_dtypes.float8_e4m3fn), f32, f32)
    out, lse = tm.attention_forward(bf, bf, bf, return_lse=True)
    with pytest.raises(TypeError, match=r"^attention_backward: dout has dtype float32 but q has "
                                        r"bfloat16; q, k, v, out, dout, dq, dk and dv must"):
        tm.attention_backward(bf, bf, bf, out, lse, f32)
    with pytest.raises(TypeError, match=r"^attention_backward: dq has dtype float32 but q has "
                                        r"bfloat16"):
        tm.attention_backward(bf, bf, bf, out, lse, bf, dq=np.zeros_like(f32))
    # A read-only bf16 output and a byte stride that is not a multiple of 2.
    ro = np.zeros_like(bf)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"^attention_forward: out is read-only"):
        tm.attention_forward(bf, bf, bf, out=ro)
    odd = np.zeros(1 * 8 * 2 * 16 * 2 + 1, dtype=np.uint8)[1:].view(ml_dtypes.bfloat16)
    assert odd.dtype == ml_dtypes.bfloat16
    with pytest.raises(tm.ArgumentError, match=r"^attention_forward: q has a byte stride of 3, "
                                               r"not a multiple of its element size \(2 bytes"):
        kv = np.zeros((2, 8, 2, 8), dtype=ml_dtypes.bfloat16)
        tm.attention_forward(np.lib.stride_tricks.as_strided(odd, (2, 8, 2, 8), (3, 64, 32, 2)),
                             kv, kv)
    # Varlen and decode name the same way.
    cu = np.array([0, 8], dtype=np.int32)
    with pytest.raises(TypeError, match=r"^attention_forward_varlen: k has dtype float32 but q "
                                        r"has bfloat16"):
        tm.attention_forward_varlen(bf[0], f32[0], bf[0], cu, cu)
    cache = tm.KVCache(1, 1, 2, 16, 8)
    cache.append(0, f32, f32)
    with pytest.raises(TypeError, match=r"^attention_decode: out has dtype float32 but q has "
                                        r"bfloat16"):
        tm.attention_decode(bf[:, :1], cache, 0, out=np.zeros((1, 1, 2, 16), np.float32))


def test_torch_dtype_errors():
    q = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    with pytest.raises(tm.UnsupportedError, match=r"key has dtype torch.float16 but query has "
                                                  r"torch.bfloat16") as e:
        tmt.scaled_dot_product_attention(q, q.half(), q)
    assert isinstance(e.value, RuntimeError)  # PyTorch raises RuntimeError for this
    with pytest.raises(NotImplementedError, match=r"value has dtype torch.float64; only "
                                                  r"torch.float32, torch.bfloat16"):
        tmt.scaled_dot_product_attention(q, q, q.double())
    with pytest.raises(RuntimeError, match=r"attn_mask must be bool or float32, or query's dtype "
                                           r"\(torch.bfloat16\)"):
        tmt.scaled_dot_product_attention(q, q, q, attn_mask=torch.zeros(8, 8).half())
    with pytest.raises(tm.UnsupportedError, match=r"varlen_attention: v has dtype torch.float32 "
                                                  r"but q has torch.bfloat16"):
        cu = torch.tensor([0, 8])
        tmt.varlen_attention(q[0, 0].unsqueeze(1), q[0, 0].unsqueeze(1),
                             q[0, 0].unsqueeze(1).float(), cu, cu, 8, 8)


# --- a bfloat16 model in Hugging Face transformers -------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_transformers_bf16_model(family):
    """transformers loads models in bfloat16: attn_implementation="tokenmix" runs them in it
    (gpt-oss's bf16 sinks widened, with their gradient). Logits on the real tokens against the
    same bf16 weights run in float32 (eager): no further than eager attention in bfloat16 is
    (twice its error, as the rest of the model rounds alike), and every parameter gets a
    bfloat16 gradient."""
    from test_transformers import _batch, _models

    eager, ours = _models(family)
    eager, ours = eager.to(torch.bfloat16), ours.to(torch.bfloat16)
    exact = copy.deepcopy(eager).float()  # (float64: the MoE grouped_mm refuses it)
    ids, mask = _batch()
    real = mask.bool()
    with torch.no_grad():
        ref = exact(ids, attention_mask=mask).logits[real].double()
        le = eager(ids, attention_mask=mask).logits[real]
    out = ours(ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100))
    lt = out.logits[real]
    assert lt.dtype == torch.bfloat16
    scale = ref.abs().max().item()
    err_ours = (lt.double() - ref).abs().max().item() / scale
    err_eager = (le.double() - ref).abs().max().item() / scale
    assert err_ours <= max(2 * err_eager, 2.0 ** -7), (family, err_ours, err_eager)
    out.loss.backward()
    for name, p in ours.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16, name
        assert torch.isfinite(p.grad).all(), name
    if family == "gpt_oss":
        assert any(n.endswith("sinks") and p.grad.abs().max() > 0
                   for n, p in ours.named_parameters())


@pytest.mark.slow  # inductor's code generation, ~20 s
def test_autocast_under_torch_compile():
    """The autocast cast is traced with the drop-in: a compiled function (fullgraph) under
    torch.autocast("cpu") gives the eager result, in bfloat16."""
    torch._dynamo.reset()
    q = torch.randn(1, 4, 16, 32, requires_grad=True)
    k, v = torch.randn(1, 2, 16, 32), torch.randn(1, 2, 16, 32)

    def f(q, k, v):
        return tmt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    with torch.autocast("cpu"):
        compiled = torch.compile(f, fullgraph=True)(q, k, v)
        eager = f(q, k, v)
    assert compiled.dtype == torch.bfloat16 and torch.equal(compiled, eager)
    compiled.float().sum().backward()
    assert q.grad.dtype == torch.float32
