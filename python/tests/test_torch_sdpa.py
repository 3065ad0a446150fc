"""Conformance of tokenmix.torch.scaled_dot_product_attention with PyTorch's SDPA.

Forward outputs and autograd gradients (query, key, value) are compared with
torch.nn.functional.scaled_dot_product_attention run in float64 on the same inputs, over a grid
of shapes (odd sizes, T_q ≠ T_k both ways, MHA / GQA / MQA, d_h from 1 to 128), is_causal on and
off, default and custom scale, and three memory layouts: contiguous [B,H,T,d_h], a transposed view
of [B,T,H,d_h], and a strided slice. Tolerances: conftest.py (FWD_*, BWD_*).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import tokenmix.torch as tmt
from conftest import BWD_ATOL, BWD_RTOL, FWD_ATOL, FWD_RTOL, assert_close, causal_mask

# (B, T_q, T_k, H_q, H_kv, d_h)
SHAPES = [
    (1, 1, 1, 1, 1, 1),
    (2, 7, 7, 3, 3, 5),
    (1, 33, 33, 4, 2, 16),
    (2, 64, 64, 8, 8, 64),
    (1, 17, 45, 4, 1, 13),
    (1, 45, 17, 6, 3, 24),
    (3, 129, 129, 2, 1, 128),
    (1, 100, 250, 2, 2, 96),
    (1, 250, 100, 2, 1, 40),
]
LAYOUTS = ["bhtd", "bthd_view", "strided"]


def make(B: int, H: int, T: int, D: int, layout: str) -> torch.Tensor:
    """A float32 [B, H, T, D] tensor in the given memory layout (a leaf that can require grad)."""
    if layout == "bhtd":
        return torch.randn(B, H, T, D)
    if layout == "bthd_view":
        return torch.randn(B, T, H, D).transpose(1, 2)
    base = torch.randn(B, H, 2 * T, D + 3)
    return base[:, :, ::2, 1 : D + 1]


def reference(q, k, v, g, **kw):
    """float64 PyTorch SDPA: output and gradients w.r.t. q, k, v for upstream gradient g."""
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = F.scaled_dot_product_attention(q64, k64, v64, **kw)
    out.backward(g.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("scale", [None, 0.37])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B%d_Tq%d_Tk%d_Hq%d_Hkv%d_d%d" % s)
def test_forward_and_gradients_match_torch(shape, is_causal, scale, layout):
    B, T_q, T_k, H_q, H_kv, D = shape
    q = make(B, H_q, T_q, D, layout).requires_grad_()
    k = make(B, H_kv, T_k, D, layout).requires_grad_()
    v = make(B, H_kv, T_k, D, layout).requires_grad_()
    if layout != "bhtd" and min(T_q, H_q) > 1:
        assert not q.is_contiguous()
    g = torch.randn(B, H_q, T_q, D)
    kw = dict(is_causal=is_causal, scale=scale, enable_gqa=H_q != H_kv)

    out = tmt.scaled_dot_product_attention(q, k, v, **kw)
    assert out.shape == (B, H_q, T_q, D) and out.dtype == torch.float32
    out.backward(g)
    ref_out, ref_dq, ref_dk, ref_dv = reference(q, k, v, g, **kw)

    assert_close(out.detach(), ref_out, FWD_ATOL, FWD_RTOL, "out")
    assert_close(q.grad, ref_dq, BWD_ATOL, BWD_RTOL, "dq")
    assert_close(k.grad, ref_dk, BWD_ATOL, BWD_RTOL, "dk")
    assert_close(v.grad, ref_dv, BWD_ATOL, BWD_RTOL, "dv")


@pytest.mark.parametrize("T_q,T_k", [(5, 12), (12, 5), (9, 9)])
def test_is_causal_is_top_left_like_pytorch(T_q, T_k):
    """PyTorch's is_causal (and so the drop-in's) is "top_left" aligned: query i sees keys j ≤ i."""
    q, k, v = torch.randn(2, 3, T_q, 8), torch.randn(2, 3, T_k, 8), torch.randn(2, 3, T_k, 8)
    ours = tmt.scaled_dot_product_attention(q, k, v, is_causal=True)
    mask = causal_mask(T_q, T_k, "top_left")
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    assert_close(ours, ref, FWD_ATOL, FWD_RTOL, "top_left vs explicit mask")


def test_packed_qkv_views_of_one_buffer():
    """q, k, v as transposed slices of one [B, T, 3, H, D] projection output: no copies, and the
    gradient reaches the packed buffer."""
    B, T, H, D = 2, 31, 4, 24
    qkv = torch.randn(B, T, 3, H, D, requires_grad=True)
    q, k, v = (x.transpose(1, 2) for x in qkv.unbind(2))
    g = torch.randn(B, H, T, D)
    out = tmt.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.backward(g)
    qkv64 = qkv.detach().double().requires_grad_()
    q64, k64, v64 = (x.transpose(1, 2) for x in qkv64.unbind(2))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
    ref.backward(g.double())
    assert_close(out.detach(), ref.detach(), FWD_ATOL, FWD_RTOL, "out")
    assert_close(qkv.grad, qkv64.grad, BWD_ATOL, BWD_RTOL, "d qkv")


@pytest.mark.parametrize("lead", [(), (3,), (2, 3)], ids=["3d", "4d", "5d"])
def test_batch_dimensions(lead):
    H_q, H_kv, T, D = 4, 2, 11, 8
    q = torch.randn(*lead, H_q, T, D, requires_grad=True)
    k = torch.randn(*lead, H_kv, T, D, requires_grad=True)
    v = torch.randn(*lead, H_kv, T, D, requires_grad=True)
    g = torch.randn(*lead, H_q, T, D)
    out = tmt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert out.shape == q.shape
    out.backward(g)
    ref_out, dq, dk, dv = reference(q, k, v, g, is_causal=True, enable_gqa=True)
    assert_close(out.detach(), ref_out, FWD_ATOL, FWD_RTOL, "out")
    for ours, ref in ((q.grad, dq), (k.grad, dk), (v.grad, dv)):
        assert_close(ours, ref, BWD_ATOL, BWD_RTOL, "grad")


def test_two_dimensional_inputs():
    q = torch.randn(9, 16)
    out = tmt.scaled_dot_product_attention(q, q, q, is_causal=True)
    ref = F.scaled_dot_product_attention(q.double(), q.double(), q.double(), is_causal=True)
    assert_close(out, ref, FWD_ATOL, FWD_RTOL, "2-d")


def test_only_some_inputs_require_grad_and_expanded_upstream_gradient():
    q = torch.randn(1, 2, 6, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    tmt.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()  # grad has stride 0
    q64 = q.detach().double().requires_grad_()
    F.scaled_dot_product_attention(q64, k.double(), v.double(), is_causal=True).sum().backward()
    assert_close(q.grad, q64.grad, BWD_ATOL, BWD_RTOL, "dq")
    assert k.grad is None and v.grad is None


def test_no_grad_and_inference_mode():
    q = torch.randn(1, 2, 6, 8, requires_grad=True)
    with torch.no_grad():
        a = tmt.scaled_dot_product_attention(q, q, q)
    with torch.inference_mode():
        b = tmt.scaled_dot_product_attention(q, q, q)
    assert not a.requires_grad and torch.equal(a, b)


def test_result_does_not_depend_on_thread_count():
    q, k, v = torch.randn(1, 4, 200, 32), torch.randn(1, 2, 200, 32), torch.randn(1, 2, 200, 32)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = tmt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        torch.set_num_threads(2)
        two = tmt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, two)


def test_gqa_needs_enable_gqa_like_pytorch():
    q, kv = torch.randn(1, 8, 4, 16), torch.randn(1, 2, 4, 16)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, kv, kv)
    with pytest.raises(RuntimeError, match="enable_gqa"):
        tmt.scaled_dot_product_attention(q, kv, kv)
    with pytest.raises(RuntimeError, match="multiple"):
        tmt.scaled_dot_product_attention(q, torch.randn(1, 3, 4, 16), torch.randn(1, 3, 4, 16),
                                         enable_gqa=True)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(query=torch.randn(1, 2, 4, 8, dtype=torch.float64)), "query has dtype torch.float64"),
        (dict(key=torch.randn(1, 2, 4, 8, dtype=torch.bfloat16)), "key has dtype torch.bfloat16"),
        (dict(value=torch.randn(1, 2, 4, 8, device="meta")), "value is on device 'meta'"),
        (dict(value=torch.randn(1, 2, 4, 6)), "value has head width 6"),
        (dict(key=torch.randn(3, 2, 4, 8), value=torch.randn(3, 2, 4, 8)), "batch dimensions"),
    ],
    ids=["float64", "bfloat16", "device", "value_width", "broadcast"],
)
def test_unsupported_arguments_raise_not_implemented(kwargs, needle):
    args = dict(query=torch.randn(1, 2, 4, 8), key=torch.randn(1, 2, 4, 8),
                value=torch.randn(1, 2, 4, 8))
    args.update(kwargs)
    with pytest.raises(NotImplementedError, match=needle):
        tmt.scaled_dot_product_attention(**args)


def test_empty_keys_give_zeros_like_pytorch():
    q, kv = torch.randn(1, 2, 5, 8), torch.randn(1, 2, 0, 8)
    out = tmt.scaled_dot_product_attention(q, kv, kv)
    assert torch.equal(out, F.scaled_dot_product_attention(q, kv, kv))


# ---------------------------------------------------------------------------------------------
# Random calls: any combination of the arguments can meet


def visible(B, H_q, T_q, T_k, attn_mask, is_causal):
    """[B, H_q, T_q, T_k] bool: key u takes part in row t (PyTorch's is_causal: top-left)."""
    vis = torch.ones(T_q, T_k, dtype=torch.bool)
    if is_causal:
        vis = vis.tril()
    if attn_mask is not None:
        vis = vis & (attn_mask if attn_mask.dtype == torch.bool else attn_mask > float("-inf"))
    return vis.expand(B, H_q, T_q, T_k)


def moved_gradients(q, k, v, o_used, g, attn_mask, is_causal, scale, groups):
    """float64 gradients of SDPA with D_t = <dO_t, O_t> formed from o_used (SPEC 4.7).

    The kernels form D from the O they are given: for bf16, O rounded to 16 bits. dS = P ⊙ (dP − D)
    is linear in D, so with o_used = the rounded O these are exactly what the kernels compute, up
    to fp32 arithmetic and the final rounding; with o_used = None (the exact O = P V), PyTorch's
    autograd gradients (the test checks that too). A row that sees no key has P = 0: no gradient
    (tokenmix's documented zeros). q, k, v, o_used, g: float64 [B, H, T, E].
    """
    K, V = k.repeat_interleave(groups, dim=-3), v.repeat_interleave(groups, dim=-3)
    s = scale if scale is not None else 1.0 / q.shape[-1] ** 0.5
    S = s * q @ K.transpose(-1, -2)
    if is_causal:  # PyTorch's is_causal: top-left, query i sees keys j <= i
        S = S.masked_fill(torch.ones(S.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    if attn_mask is not None:
        S = S.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else S + attn_mask
    P = torch.softmax(S, dim=-1).nan_to_num(0.0)  # softmax of a row of −∞ alone: NaN → 0
    D = (g * (P @ V if o_used is None else o_used)).sum(-1, keepdim=True)
    dS = P * (g @ V.transpose(-1, -2) - D)
    dq, dK, dV = s * dS @ K, s * dS.transpose(-1, -2) @ q, P.transpose(-1, -2) @ g
    B, H_kv, T, E = k.shape
    return dq, dK.view(B, H_kv, groups, T, E).sum(2), dV.view(B, H_kv, groups, T, E).sum(2)


def test_random_calls_match_float64_sdpa():
    """80 calls from one fixed seed, each against float64 PyTorch SDPA on the same (rounded) inputs:
    B, H_kv, GQA ratio, T_q and T_k (tile edges, T_q ≶ T_k), d_h (1 … 64), float32 or bfloat16,
    is_causal, scale, memory layout per tensor, a boolean or additive mask broadcast over any of
    its dimensions (some rows fully masked), which inputs require grad.

    Output: float32 FWD_* (conftest.py); bfloat16 one rounding of an fp32 result, 2^-8 of max|O|,
    plus 2^-8 of max|v| where the path rounds P before P·V (avx512_bf16). A row that sees no key
    gives 0 (documented; so does the PyTorch 2.15 of these tests, where older versions gave NaN:
    only the rows that see a key are compared with PyTorch). Gradients against moved_gradients: float32 with the exact O, BWD_*;
    bfloat16 with the rounded O, one rounding plus the fp32 error (no allowance for D). Where every
    row sees a key, moved_gradients with the exact O is checked against PyTorch's autograd.
    """
    rnd = random.Random(20261206)
    for draw in range(80):
        B, H_kv, groups = rnd.randint(1, 3), rnd.randint(1, 3), rnd.randint(1, 3)
        H_q = H_kv * groups
        T_q = rnd.choice([1, 2, 7, 63, 64, 65, rnd.randint(1, 100)])
        T_k = rnd.choice([T_q, rnd.randint(1, 100)])
        E = rnd.choice([1, 3, 8, 16, 17, 64])
        dtype = rnd.choice([torch.float32, torch.float32, torch.bfloat16])
        is_causal = rnd.random() < 0.4
        scale = rnd.choice([None, None, 0.3, 1.7])
        gen = torch.Generator().manual_seed(draw)

        def tensor(H, T):
            if rnd.random() < 0.3:  # a transposed view of [B, T, H, E]
                x = torch.randn(B, T, H, E, generator=gen, dtype=torch.float64).to(dtype)
                x = x.transpose(1, 2)
            else:
                x = torch.randn(B, H, T, E, generator=gen, dtype=torch.float64).to(dtype)
            return x.requires_grad_(rnd.random() < 0.7)

        q, k, v = tensor(H_q, T_q), tensor(H_kv, T_k), tensor(H_kv, T_k)
        mask = None
        if not is_causal and rnd.random() < 0.5:
            shape = [rnd.choice([1, B]), rnd.choice([1, H_q]), rnd.choice([1, T_q]),
                     rnd.choice([1, T_k])]
            if rnd.random() < 0.5:
                mask = torch.rand(*shape, generator=gen) < 0.8
            else:
                mask = torch.randn(*shape, generator=gen)
                mask[torch.rand(*shape, generator=gen) < 0.1] = float("-inf")
        kw = dict(attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=groups > 1)
        what = f"draw {draw}: B {B} H {H_q}/{H_kv} T {T_q}x{T_k} E {E} {dtype} causal {is_causal}"

        out = tmt.scaled_dot_product_attention(q, k, v, **kw)
        assert out.dtype == dtype and out.shape == (B, H_q, T_q, E), what
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
        m64 = mask.double() if mask is not None and mask.is_floating_point() else mask
        ref = F.scaled_dot_product_attention(q64, k64, v64, **dict(kw, attn_mask=m64))
        seen = visible(B, H_q, T_q, T_k, mask, is_causal).any(-1)  # rows that see a key
        assert torch.all(out.detach()[~seen] == 0), what
        if dtype == torch.float32:
            assert_close(out.detach()[seen], ref.detach()[seen], FWD_ATOL, FWD_RTOL, what)
        else:
            extra = 2.0**-8 * v64.abs().max().item()
            assert_close(out.detach()[seen], ref.detach()[seen], FWD_ATOL + extra,
                         2.0**-8 + FWD_RTOL, what)
        if not any(x.requires_grad for x in (q, k, v)):
            continue
        g = torch.randn(B, H_q, T_q, E, generator=gen, dtype=torch.float64).to(dtype)
        out.backward(g)
        args = (q64.detach(), k64.detach(), v64.detach())
        rest = (g.double(), m64, is_causal, scale, groups)
        exact = moved_gradients(*args, None, *rest)
        moved = moved_gradients(*args, out.detach().double(), *rest)
        if bool(seen.all()):
            ref.backward(g.double())
            for e, x64, name in zip(exact, (q64, k64, v64), "qkv"):
                assert_close(e, x64.grad, 1e-10, 1e-10, f"{what}: d{name} formula vs autograd")
        for x, e, m, name in zip((q, k, v), exact, moved, "qkv"):
            if not x.requires_grad:
                assert x.grad is None, what
            elif dtype == torch.float32:
                assert_close(x.grad, e, BWD_ATOL, BWD_RTOL, f"{what}: d{name}")
            else:
                bound = 2.0**-8 + BWD_ATOL
                assert_close(x.grad, m, bound, bound, f"{what}: d{name}")
