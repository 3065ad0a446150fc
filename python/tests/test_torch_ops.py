"""The registered operators torch.ops.tokenmix.* (python/tokenmix/_torch_ops.py) and what they
make possible for tokenmix.torch: torch.library.opcheck on each operator, torch.compile
(fullgraph=True: no graph break) of a function and of a small model, torch.export,
torch.func.grad, vmap (and vmap of grad: per-sample gradients, sinks included), the thread count
read at run time, dtype errors and the refused double backward.

Results are compared with the eager drop-in (the same kernels: identical up to float32 rounding
of differently fused graphs, so tolerances are a few ulps) or, for the maths, with PyTorch in
float64 (conftest's FWD_*/BWD_* tolerances). Variants: SPEC "Score variants used by real models".
"""

import pytest
import torch

import tokenmix
import tokenmix.torch as tmt
from tokenmix import _native, _torch_ops

from conftest import BWD_ATOL, BWD_RTOL, FWD_ATOL, FWD_RTOL, assert_close

OPS = torch.ops.tokenmix


def _inputs(B=2, H_q=4, H_kv=2, L=7, S=7, E=8, grad=True):
    q = torch.randn(B, H_q, L, E, requires_grad=grad)
    k = torch.randn(B, H_kv, S, E, requires_grad=grad)
    v = torch.randn(B, H_kv, S, E, requires_grad=grad)
    return q, k, v


def _reference(q, k, v, mask=None, sinks=None, window=None, softcap=None, causal=True):
    """float64 attention with PyTorch ops, top-left causal (L == S here), SPEC 4.2–4.5."""
    q, k, v = q.double(), k.double(), v.double()
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    L, S = s.shape[-2:]
    vis = torch.ones(L, S, dtype=torch.bool)
    if causal:
        vis = vis.tril()
    if window is not None:
        vis &= torch.ones(L, S, dtype=torch.bool).triu(-(window - 1))
    if mask is not None:
        vis = vis & mask
    s = s.masked_fill(~vis, float("-inf"))
    if sinks is not None:
        sk = sinks.double().view(1, -1, 1, 1).expand(s.shape[0], -1, L, 1)
        p = torch.cat([s, sk], -1).softmax(-1)[..., :-1]
    else:
        p = s.softmax(-1)
    return p @ v


# ---------------------------------------------------------------------------------------------
# opcheck


OPTION_SETS = {
    "causal": dict(),
    "bool_mask": dict(mask="bool"),
    "float_mask": dict(mask="float"),
    "variants": dict(window=3, softcap=2.0, sinks=True, alibi=True),
    "bottom_right_gqa": dict(bottom_right=True, S=11),
    "dropout": dict(dropout=0.25, sinks=True),  # the seed an int64 tensor [2] (docs/design.md D.3)
}


def _op_args(name):
    o = OPTION_SETS[name]
    S = o.get("S", 7)
    q, k, v = _inputs(S=S)
    mask = None
    if o.get("mask") == "bool":
        mask = torch.rand(2, 1, 7, S) > 0.3
    elif o.get("mask") == "float":
        mask = torch.randn(1, 4, 7, S)
    sinks = torch.randn(4, requires_grad=True) if o.get("sinks") else None
    alibi = torch.rand(4) if o.get("alibi") else None
    causal = mask is None
    args = (q, k, v, mask, alibi, sinks, None if name != "variants" else 0.3, causal,
            o.get("bottom_right", False), o.get("window"), o.get("softcap"))
    if o.get("dropout"):
        args += (o["dropout"], torch.tensor([1234, 5], dtype=torch.int64))
    return args


@pytest.mark.parametrize("name", list(OPTION_SETS))
def test_opcheck_forward_and_backward(name):
    args = _op_args(name)
    torch.library.opcheck(OPS.attention_forward.default, args)
    q, k, v = args[:3]
    out, lse = OPS.attention_forward(*[a.detach() if isinstance(a, torch.Tensor) else a
                                       for a in args])
    dout = torch.randn_like(out)
    bargs = (dout, q.detach(), k.detach(), v.detach(), out, lse) + tuple(
        a.detach() if isinstance(a, torch.Tensor) else a for a in args[3:])
    torch.library.opcheck(OPS.attention_backward.default, bargs)


def _varlen_args(grad=True):
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 6, 11], dtype=torch.int32)
    q = torch.randn(8, 4, 8, requires_grad=grad)
    k = torch.randn(11, 2, 8, requires_grad=grad)
    v = torch.randn(11, 2, 8, requires_grad=grad)
    sinks = torch.randn(4, requires_grad=grad)
    return (q, k, v, cu_q, cu_k, None, sinks, None, True, True, 5, None)


def test_opcheck_varlen():
    args = _varlen_args()
    torch.library.opcheck(OPS.varlen_forward.default, args)
    d = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
    out, lse = OPS.varlen_forward(*d)
    bargs = (torch.randn_like(out), d[0], d[1], d[2], out, lse) + tuple(d[3:])
    torch.library.opcheck(OPS.varlen_backward.default, bargs)


def test_operator_matches_drop_in_bitwise():
    """The eager drop-in (which skips the dispatcher) and the operator run the same code."""
    q, k, v = _inputs(grad=False)
    sinks = torch.randn(4)
    ref = tmt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, window=3,
                                           sinks=sinks)
    out, lse = OPS.attention_forward(q, k, v, None, None, sinks, None, True, False, 3, None)
    assert torch.equal(out, ref)
    assert out.transpose(1, 2).is_contiguous()  # [B, L, H, E] memory, like PyTorch's flash
    assert lse.shape == (2, 4, 7)


def test_operator_autograd_matches_reference():
    """torch.ops.tokenmix.attention_forward's own autograd formula (register_autograd)."""
    q, k, v = _inputs()
    sinks = torch.randn(4, requires_grad=True)
    out, lse = OPS.attention_forward(q, k, v, None, None, sinks, None, True, False, 3, 2.0)
    assert not lse.requires_grad
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
    ref = _reference(q, k, v, sinks=sinks, window=3, softcap=2.0)
    ref_grads = torch.autograd.grad(ref, (q, k, v, sinks), dout.double())
    assert_close(out, ref, FWD_ATOL, FWD_RTOL, "out")
    for name, g, r in zip(("dq", "dk", "dv", "dsinks"), grads, ref_grads):
        assert_close(g, r, BWD_ATOL, BWD_RTOL, name)


# ---------------------------------------------------------------------------------------------
# torch.compile, torch.export


def _sdpa_variants(q, k, v, sinks):
    return tmt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, window=4,
                                            softcap=3.0, sinks=sinks)


def test_compile_fullgraph_function_forward_and_backward():
    torch._dynamo.reset()
    q, k, v = _inputs()
    sinks = torch.randn(4, requires_grad=True)
    compiled = torch.compile(_sdpa_variants, fullgraph=True)  # a graph break would raise
    out = compiled(q, k, v, sinks)
    ref = _sdpa_variants(q, k, v, sinks)
    assert_close(out, ref, 1e-6, 1e-6, "compiled out")
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v, sinks), dout)
    r = torch.autograd.grad(ref, (q, k, v, sinks), dout)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), g, r):
        assert_close(a, b, 1e-6, 1e-6, f"compiled {name}")


class _TinyAttentionModel(torch.nn.Module):
    """Projections + tokenmix attention with a bool padding mask + output projection."""

    def __init__(self, d=32, h=4, h_kv=2):
        super().__init__()
        self.h, self.h_kv, self.e = h, h_kv, d // h
        self.q = torch.nn.Linear(d, d)
        self.kv = torch.nn.Linear(d, 2 * h_kv * self.e)
        self.o = torch.nn.Linear(d, d)

    def forward(self, x, mask):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.h, self.e).transpose(1, 2)
        k, v = self.kv(x).view(B, T, 2, self.h_kv, self.e).permute(2, 0, 3, 1, 4)
        y = tmt.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))


def test_compile_fullgraph_model_and_export():
    torch._dynamo.reset()
    model = _TinyAttentionModel()
    x = torch.randn(2, 9, 32)
    mask = torch.ones(9, 9, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    mask[1, :, :, :3] = False  # left padding of sequence 1
    mask[1, :, :3, :3] = torch.eye(3, dtype=torch.bool)  # padded rows see themselves
    ref = model(x, mask)
    out = torch.compile(model, fullgraph=True)(x, mask)
    assert_close(out, ref, 1e-6, 1e-6, "compiled model")
    out.sum().backward()
    g_compiled = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref.sum().backward()
    for a, p in zip(g_compiled, model.parameters()):
        assert_close(a, p.grad, 1e-6, 1e-6, "compiled model gradient")

    ep = torch.export.export(model, (x, mask))
    assert "torch.ops.tokenmix.attention_forward" in ep.graph_module.code
    assert_close(ep.module()(x, mask), ref, 1e-6, 1e-6, "exported model")


def test_export_with_a_dynamic_sequence_length():
    """The fake implementations compute shapes symbolically: one exported program serves every
    T (here 9 when exported, 33 when run)."""

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return tmt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                    window=3)

    q, k, v = _inputs(L=9, S=9, grad=False)
    T = torch.export.Dim("T", min=2, max=512)
    ep = torch.export.export(M(), (q, k, v), dynamic_shapes=({2: T}, {2: T}, {2: T}))
    q, k, v = _inputs(L=33, S=33, grad=False)
    assert torch.equal(ep.module()(q, k, v), M()(q, k, v))


def test_threads_are_read_when_the_operator_runs():
    """The compiled graph has no thread count baked in: the operator reads it at run time (and
    the result does not depend on it)."""
    torch._dynamo.reset()
    q, k, v = _inputs(B=1, H_q=2, H_kv=2, L=130, S=130, grad=False)
    f = torch.compile(lambda q, k, v: tmt.scaled_dot_product_attention(q, k, v, is_causal=True),
                      fullgraph=True)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = f(q, k, v)
        torch.set_num_threads(2)
        two = f(q, k, v)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


# ---------------------------------------------------------------------------------------------
# torch.func


def test_func_grad_matches_autograd():
    q, k, v = _inputs()
    sinks = torch.randn(4, requires_grad=True)

    def loss(q, k, v, sinks):
        return _sdpa_variants(q, k, v, sinks).square().sum()

    g = torch.func.grad(loss, argnums=(0, 1, 2, 3))(q.detach(), k.detach(), v.detach(),
                                                   sinks.detach())
    r = torch.autograd.grad(loss(q, k, v, sinks), (q, k, v, sinks))
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), g, r):
        assert_close(a, b, 1e-6, 1e-6, f"func.grad {name}")


def test_vmap_over_a_batch_dim_matches_a_loop():
    q, k, v = _inputs(grad=False)
    qs = torch.randn((3,) + q.shape)
    mask = torch.rand(3, 2, 1, 7, 7) > 0.4
    f = (lambda q, k, v, m: tmt.scaled_dot_product_attention(q, k, v, attn_mask=m,
                                                             enable_gqa=True))
    out = torch.func.vmap(f, in_dims=(0, None, None, 0))(qs, k, v, mask)
    for i in range(3):
        assert torch.allclose(out[i], f(qs[i], k, v, mask[i]), atol=1e-6, rtol=0)
    # vmapped axis not first, sinks unbatched
    sinks = torch.randn(4)
    g = (lambda q, k, v: _sdpa_variants(q, k, v, sinks))
    out = torch.func.vmap(g, in_dims=(2, None, None), out_dims=1)(qs.movedim(0, 2), k, v)
    for i in range(3):
        assert torch.allclose(out[:, i], g(qs[i], k, v), atol=1e-6, rtol=0)


def test_vmap_of_grad_gives_per_sample_gradients():
    """Per-sample gradients of q and of the (shared) sinks: dsinks sums over a batch, so the
    vmapped axis must not be merged into it."""
    q, k, v = _inputs(B=4, grad=False)
    sinks = torch.randn(4)

    def loss(sinks, q, k, v):
        return _sdpa_variants(q[None], k[None], v[None], sinks).square().sum()

    per = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(None, 0, 0, 0))(
        sinks, q, k, v)
    for i in range(4):
        ref = torch.func.grad(loss, argnums=(0, 1))(sinks, q[i], k[i], v[i])
        assert torch.allclose(per[0][i], ref[0], atol=1e-5, rtol=1e-5)
        assert torch.allclose(per[1][i], ref[1], atol=1e-5, rtol=1e-5)


def test_vmap_of_grad_without_sinks_merges_the_batch():
    """No sinks: the vmap rules merge the vmapped axis into B (forward and backward); an
    unbatched mask with a batch of its own is expanded over the vmapped axis."""
    q, k, v = _inputs(B=2, grad=False)
    qs = torch.randn((3,) + q.shape)
    mask = torch.rand(2, 1, 7, 7) > 0.3

    def loss(q, k, v):
        return tmt.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                enable_gqa=True).square().sum()

    per = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(0, None, None))(
        qs, k, v)
    for i in range(3):
        ref = torch.func.grad(loss, argnums=(0, 1))(qs[i], k, v)
        assert torch.allclose(per[0][i], ref[0], atol=1e-5, rtol=1e-5)
        assert torch.allclose(per[1][i], ref[1], atol=1e-5, rtol=1e-5)


def test_vmap_varlen():
    q, k, v, cu_q, cu_k = [a for a in _varlen_args(grad=False)[:5]]
    qs = torch.randn((2,) + q.shape)
    f = (lambda q: tmt.varlen_attention(q, k, v, cu_q, cu_k, 5, 5))
    out = torch.func.vmap(f)(qs)
    for i in range(2):
        assert torch.equal(out[i], f(qs[i]))


# ---------------------------------------------------------------------------------------------
# Errors


def test_double_backward_raises():
    q, k, v = _inputs()
    for run in (lambda: tmt.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                          enable_gqa=True),
                lambda: OPS.attention_forward(q, k, v, None, None, None, None, True, False, None,
                                              None)[0]):
        (dq,) = torch.autograd.grad(run().square().sum(), q, create_graph=True)
        with pytest.raises(tokenmix.UnsupportedError, match="double backward"):
            dq.sum().backward()
    vq, vk, vv, cu_q, cu_k = _varlen_args()[:5]
    (dq,) = torch.autograd.grad(tmt.varlen_attention(vq, vk, vv, cu_q, cu_k, 5, 5).sum(), vq,
                                create_graph=True)
    with pytest.raises(tokenmix.UnsupportedError, match="double backward"):
        dq.sum().backward()
    with pytest.raises(tokenmix.UnsupportedError, match="double backward"):
        torch.func.grad(lambda x: torch.func.grad(
            lambda y: tmt.scaled_dot_product_attention(y, k.detach(), k.detach(),
                                                       enable_gqa=True).sum())(x).sum())(
            q.detach())


@pytest.mark.parametrize("dtype", [torch.float64])  # bf16/f16 are supported (test_bf16.py)
def test_other_dtypes_raise_a_tokenmix_error(dtype):
    q, k, v = (t.detach().to(dtype) for t in _inputs())
    with pytest.raises(tokenmix.UnsupportedError, match="dtype"):
        tmt.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    with pytest.raises(tokenmix.UnsupportedError, match="dtype"):
        torch.compile(lambda q, k, v: tmt.scaled_dot_product_attention(q, k, v,
                                                                       enable_gqa=True))(q, k, v)
    # Mixed dtypes are refused too (bf16 query, float32 key/value), traced or not.
    q16 = q.to(torch.bfloat16)
    k32, v32 = k.float(), v.float()
    with pytest.raises(tokenmix.UnsupportedError, match="dtype"):
        tmt.scaled_dot_product_attention(q16, k32, v32, enable_gqa=True)
    with pytest.raises(tokenmix.UnsupportedError, match="dtype"):
        torch.compile(lambda q, k, v: tmt.scaled_dot_product_attention(q, k, v,
                                                                       enable_gqa=True))(
            q16, k32, v32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compile_fullgraph_reduced_precision(dtype):
    """bf16/f16 through the registered operators (fake implementations: out and the gradients
    in q's dtype, lse and dsinks float32): compiled equals eager, bit for bit."""
    torch._dynamo.reset()
    q, k, v = (t.detach().to(dtype).requires_grad_() for t in _inputs())
    sinks = torch.randn(4, requires_grad=True)
    compiled = torch.compile(_sdpa_variants, fullgraph=True)
    out = compiled(q, k, v, sinks)
    ref = _sdpa_variants(q, k, v, sinks)
    assert out.dtype == ref.dtype == dtype and torch.equal(out, ref)
    dout = torch.randn_like(out)
    g = torch.autograd.grad(out, (q, k, v, sinks), dout)
    r = torch.autograd.grad(ref, (q, k, v, sinks), dout)
    for name, a, b in zip(("dq", "dk", "dv", "dsinks"), g, r):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert g[0].dtype == dtype and g[3].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float64])  # bf16/f16 run (test_bf16.py)
def test_operators_refuse_other_dtypes(dtype):
    q, k, v = (t.detach().to(dtype) for t in _inputs())
    with pytest.raises(tokenmix.UnsupportedError, match=f"q has dtype {dtype}"):
        OPS.attention_forward(q, k, v, None, None, None, None, True, False, None, None)
    with pytest.raises(tokenmix.UnsupportedError, match=f"q has dtype {dtype}"):
        OPS.attention_backward(q, q, k, v, q, q[..., 0], None, None, None, None, True, False,
                               None, None)
    vq, vk, vv, cu_q, cu_k = (a.detach() for a in _varlen_args()[:5])
    with pytest.raises(tokenmix.UnsupportedError, match=f"q has dtype {dtype}"):
        OPS.varlen_forward(vq.to(dtype), vk, vv, cu_q, cu_k, None, None, None, True, True, None,
                           None)
    # Under tracing the fake implementation raises it (dynamo reports it inside its own
    # Unsupported error under fullgraph=True).
    with pytest.raises(Exception, match="q has dtype .* only torch.float32, torch.bfloat16 "
                                        "and torch.float16 are supported"):
        torch.compile(lambda q: OPS.attention_forward(q, q, q, None, None, None, None, True,
                                                      False, None, None)[0], fullgraph=True)(q)
    # Mixed dtypes (bf16 q, float32 k/v) are refused by the operators too.
    with pytest.raises(tokenmix.UnsupportedError, match="k has dtype torch.float32 but q has "
                                                        "torch.bfloat16"):
        OPS.varlen_forward(vq.bfloat16(), vk, vv, cu_q, cu_k, None, None, None, True, True, None,
                           None)


def test_operator_refuses_gradients_it_cannot_compute():
    q, k, v = _inputs()
    bias = torch.randn(1, 1, 7, 7, requires_grad=True)
    with pytest.raises(tokenmix.UnsupportedError, match="attn_mask requires grad"):
        OPS.attention_forward(q, k, v, bias, None, None, None, False, False, None, None)
    slopes = torch.rand(4, requires_grad=True)
    with pytest.raises(tokenmix.UnsupportedError, match="alibi_slopes requires grad"):
        OPS.attention_forward(q, k, v, None, slopes, None, None, True, False, None, None)


def test_plain_eager_detection():
    q = torch.randn(2, 2)
    assert _torch_ops.plain_eager(q)
    seen = []
    torch.func.vmap(lambda x: seen.append(_torch_ops.plain_eager(x)) or x)(q)
    torch.compile(lambda x: seen.append(_torch_ops.plain_eager(x)) or x, backend="eager")(q)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        seen.append(_torch_ops.plain_eager(torch.empty(2)))
    assert seen == [False, False, False]


# ---------------------------------------------------------------------------------------------
# The pointer route of plain eager calls without score variants (_C._attention_*_ptr)


def _numpy_route_forward(q, k, v, causal, bottom_right):
    """The NumPy-view route (what calls with score variants take), for comparison."""
    B, H, L, E = q.shape
    out = torch.empty((B, L, H, E), dtype=q.dtype)
    lse = torch.empty((B, H, L), dtype=torch.float32)
    t = lambda x: _torch_ops._np(x.transpose(1, 2))  # noqa: E731
    _torch_ops._C.attention_forward(t(q), t(k), t(v), _torch_ops._np(out), lse.numpy(), None,
                                    causal, ("top_left", "bottom_right")[bottom_right], 1, "auto")
    return out.transpose(1, 2), lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("L,S,bottom_right", [(1, 300, True), (8, 8, False), (5, 70, True),
                                              (20, 20, False)])
def test_pointer_route_matches_numpy_route_bitwise(dtype, L, S, bottom_right):
    """Strided views (sliced from larger tensors), GQA, T_q on both sides of the short-query
    limit: the pointer route gives the NumPy route's bits, forward and backward."""
    g = torch.Generator().manual_seed(18)
    big = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    q = big(2, 4, L + 3, 12)[:, :, 2:L + 2, 1:9]  # strides of a larger tensor
    k = big(2, 2, S, 8)
    v = big(2, 8, S, 8)[:, ::4]  # every 4th head
    out, lse = _torch_ops._forward_impl(q, k, v, None, None, None, None, True, bottom_right,
                                        None, None)
    ref_out, ref_lse = _numpy_route_forward(q, k, v, True, bottom_right)
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
    dout = big(2, 4, L, 8)
    got = _torch_ops._backward_impl(dout, q, k, v, out, lse, None, None, None, None, True,
                                    bottom_right, None, None)
    t = lambda x: _torch_ops._np(x.transpose(1, 2))  # noqa: E731
    want = [torch.empty_like(x) for x in (q, k, v)]
    _torch_ops._C.attention_backward(t(q), t(k), t(v), t(out), _torch_ops._np(lse), t(dout),
                                     *[t(x) for x in want], None, True,
                                     ("top_left", "bottom_right")[bottom_right], 1, "auto")
    for a, b in zip(got[:3], want):
        assert torch.equal(a, b)


def test_pointer_route_refuses_an_unknown_dtype_code():
    q = torch.randn(1, 1, 2, 4)
    lse = torch.empty(1, 1, 2)
    out = torch.empty(1, 2, 1, 4)
    args = [q.data_ptr(), 0, q.shape, q.stride()] * 3 + [out.data_ptr(), out.stride(),
                                                          lse.data_ptr(), lse.stride(), None,
                                                          True, False, 1]
    args[5] = 7  # k's dtype code
    with pytest.raises(tokenmix.ArgumentError, match="attention_forward: k must be float32"):
        _torch_ops._C._attention_forward_ptr(*args)


def test_calls_without_gradients_build_no_autograd_node():
    """Inference calls (no_grad, or no input requiring grad) skip the autograd Function and give
    the same bits as a call that builds the graph."""
    q, k, v = _inputs(L=1, S=40)
    with_graph = tmt.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert with_graph.grad_fn is not None
    with torch.no_grad():
        plain = tmt.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert plain.grad_fn is None and torch.equal(plain, with_graph.detach())
    detached = tmt.scaled_dot_product_attention(q.detach(), k.detach(), v.detach(),
                                                enable_gqa=True)
    assert detached.grad_fn is None and torch.equal(detached, plain)


@pytest.mark.parametrize("route", ["native", "python"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("causal", [True, False])
def test_eager_plain_function_matches_general_route_bitwise(dtype, causal, route, monkeypatch):
    """tokenmix.torch's call without score variants takes the C++ autograd node
    (tokenmix._native, "native") or, without it, _EagerPlain ("python"; issue 18: the fewest
    arguments, the pointer route in its backward); its output and gradients are the bits of the
    general autograd.Function (_Attention, which the operators' routes share), and a double
    backward through it is refused as on every route."""
    if route == "python":
        monkeypatch.setattr(_native, "attention", None)
    g = torch.Generator().manual_seed(181)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    q0, k0, v0 = mk(2, 4, 8, 64), mk(2, 2, 8, 64), mk(2, 2, 8, 64)
    dout = mk(2, 4, 8, 64)
    applied = []
    real_apply = _torch_ops._EagerPlain.apply
    _torch_ops._EagerPlain.apply = lambda *a: applied.append(1) or real_apply(*a)
    try:
        q, k, v = (t.clone().requires_grad_() for t in (q0, k0, v0))
        out = tokenmix.torch.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                          enable_gqa=True)
        out.backward(dout)
    finally:
        _torch_ops._EagerPlain.apply = real_apply
    if route == "python":
        assert applied == [1]
    else:
        assert applied == [] and "PlainAttention" in out.grad_fn.name()
    q2, k2, v2 = (t.clone().requires_grad_() for t in (q0, k0, v0))
    ref = _torch_ops._Attention.apply(q2, k2, v2, None, None, None,
                                      (None, causal, False, None, None))[0]
    ref.backward(dout)
    assert torch.equal(out, ref)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert a.grad.dtype == dtype and torch.equal(a.grad, b.grad)
    q3, k3, v3 = (t.clone().requires_grad_() for t in (q0, k0, v0))
    o3 = tokenmix.torch.scaled_dot_product_attention(q3, k3, v3, is_causal=causal,
                                                     enable_gqa=True)
    (gq,) = torch.autograd.grad(o3, q3, dout, create_graph=True)
    with pytest.raises(tokenmix.UnsupportedError, match="double backward"):
        gq.sum().backward()


def test_native_node_is_built_loaded_and_raises_tokenmix_errors():
    """The C++ autograd node (tokenmix._native) is built with the package here (CI builds with
    torch importable) and in use; the library's errors come back as tokenmix's exception types
    with their codes, not as PyTorch's RuntimeError."""
    assert _native.status.startswith("loaded (bundled"), _native.status
    assert _native.attention is not None
    q = torch.randn(1, 4, 8, 64, requires_grad=True)
    k = torch.randn(1, 2, 8, 32)  # head width 32 ≠ 64
    with pytest.raises(tokenmix.ArgumentError, match="attention_forward") as info:
        _native.attention(q, k, k, None, True)
    assert info.value.code == "shape_mismatch"
    with pytest.raises(tokenmix.ArgumentError, match="q must be a strided rank-4") as info:
        _native.attention(q[0], k, k, None, True)
    assert info.value.code == "shape_mismatch"
    with pytest.raises(tokenmix.ArgumentError, match="scale") as info:
        _native.attention(q, q, q, float("nan"), True)
    assert info.value.code == "invalid_argument"
    out = _native.attention(q, q.detach(), q.detach(), 0.125, False)
    ref = torch.nn.functional.scaled_dot_product_attention(q, q, q, scale=0.125)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
