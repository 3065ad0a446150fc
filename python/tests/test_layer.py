"""tokenmix.CausalSelfAttention (SPEC 4.1–4.5) against the same layer written with torch ops and
differentiated by autograd, in float64; and prefill/step through a KV cache against forward."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tokenmix as tm
from conftest import assert_close


def torch_rope(x, pairing, base):
    """x [B, T, H, D] float64 rotated at positions t (SPEC 4.1, RoPE)."""
    B, T, H, D = x.shape
    theta = base ** (-2.0 * torch.arange(D // 2, dtype=torch.float64) / D)
    phi = torch.arange(T, dtype=torch.float64)[:, None] * theta[None, :]
    cos, sin = phi.cos()[None, :, None, :], phi.sin()[None, :, None, :]
    if pairing == "rotate_half":
        a, b = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)


def torch_layer(u, w_q, w_k, w_v, w_o, H_q, H_kv, D, rope, base, scale):
    B, T, _ = u.shape
    q = (u @ w_q).view(B, T, H_q, D)
    k = (u @ w_k).view(B, T, H_kv, D)
    v = (u @ w_v).view(B, T, H_kv, D)
    if rope:
        q, k = torch_rope(q, rope, base), torch_rope(k, rope, base)
    y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, scale=scale, enable_gqa=True)
    return y.transpose(1, 2).reshape(B, T, H_q * D) @ w_o


@pytest.mark.parametrize(
    "d,H_q,H_kv,D,rope,scale",
    [(32, 4, 4, 8, None, None), (48, 6, 2, 8, "rotate_half", None),
     (40, 4, 1, 10, "interleaved", 0.25), (64, 2, 2, 32, "rotate_half", None)],
)
def test_layer_forward_backward_match_torch_autograd(d, H_q, H_kv, D, rope, scale):
    B, T = 2, 19
    layer = tm.CausalSelfAttention(d, H_q, H_kv, D, rope=rope, rope_base=1000.0, scale=scale,
                                   seed=7)
    u = np.random.standard_normal((B, T, d)).astype(np.float32)
    d_out = np.random.standard_normal((B, T, d)).astype(np.float32)
    out = layer.forward(u)
    grads = layer.backward(d_out)

    weights = [torch.from_numpy(w.copy()).double().requires_grad_()
               for w in (layer.w_q, layer.w_k, layer.w_v, layer.w_o)]
    u64 = torch.from_numpy(u).double().requires_grad_()
    ref = torch_layer(u64, *weights, H_q, H_kv, D, rope, 1000.0, scale)
    ref.backward(torch.from_numpy(d_out).double())

    assert_close(out, ref.detach(), 3e-5, 1e-4, "O")
    assert_close(grads.d_u, u64.grad, 1e-4, 2e-4, "dU")
    for name, ours, w in zip(("dW_Q", "dW_K", "dW_V", "dW_O"), grads[1:], weights):
        assert_close(ours, w.grad, 1e-4, 2e-4, name)
    saved = layer.saved()
    assert saved["q"].shape == (B, T, H_q, D) and saved["lse"].shape == (B, H_q, T)


def test_weights_are_views_and_assignment_copies():
    layer = tm.CausalSelfAttention(16, 2)
    assert layer.head_dim == 8 and layer.heads_kv == 2
    assert not layer.w_q.any()  # zero until initialised
    view = layer.w_q
    layer.w_q = np.ones((16, 16))  # float64 is converted on assignment (a copy anyway)
    assert (view == 1).all()
    t = torch.from_numpy(layer.w_o)  # shares the layer's memory
    t.fill_(2.0)
    assert (layer.w_o == 2).all()
    with pytest.raises(ValueError, match="shape"):
        layer.w_k = np.ones((3, 3), np.float32)
    with pytest.raises(tm.ArgumentError):
        tm.CausalSelfAttention(16, 3, 2)  # H_kv must divide H_q
    with pytest.raises(tm.ArgumentError):
        layer.backward(np.zeros((1, 2, 16), np.float32))  # no forward yet


def test_layer_with_torch_tensors():
    layer = tm.CausalSelfAttention(16, 4, 2, seed=1)
    u = torch.randn(1, 5, 16)
    out = layer(u)
    assert isinstance(out, torch.Tensor) and out.shape == (1, 5, 16)
    grads = layer.backward(torch.ones(1, 5, 16))
    assert isinstance(grads.d_w_q, torch.Tensor) and grads.d_w_q.shape == (16, 16)


def test_prefill_then_steps_equal_forward():
    d, H_q, H_kv, D, P, S = 32, 4, 2, 8, 6, 3
    layer = tm.CausalSelfAttention(d, H_q, H_kv, D, rope="rotate_half", seed=3)
    u = np.random.standard_normal((2, P + S, d)).astype(np.float32)
    full = layer.forward(u)
    cache = tm.KVCache(layers=1, batch=2, heads_kv=H_kv, head_dim=D, capacity=64)
    outs = [layer.prefill(np.ascontiguousarray(u[:, :P]), cache, 0)]
    for s in range(S):
        outs.append(layer.step(np.ascontiguousarray(u[:, P + s]), cache, 0)[:, None])
    assert cache.length(0) == P + S
    assert np.allclose(np.concatenate(outs, 1), full, atol=1e-5)
