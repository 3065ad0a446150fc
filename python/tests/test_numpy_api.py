"""The NumPy-level API: zero-copy inputs/outputs, alignment, lse, backward, merge, RoPE, softmax
and its Jacobian, KV-cache decode, errors, and the GIL. Yardstick: float64 PyTorch
(tolerances in conftest.py)."""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tokenmix as tm
from conftest import BWD_ATOL, BWD_RTOL, FWD_ATOL, FWD_RTOL, assert_close, causal_mask


def rand(*shape):
    return np.random.standard_normal(shape).astype(np.float32)


def ref_attention(q, k, v, mask=None, scale=None):
    """float64 attention over [B, T, H, D] NumPy arrays with an explicit boolean mask [T_q, T_k];
    returns out [B, T_q, H_q, D] and lse [B, H_q, T_q]. Rows with no visible key: O = 0, L = −inf."""
    q64, k64, v64 = (torch.from_numpy(x).double().transpose(1, 2) for x in (q, k, v))
    g = q64.shape[1] // k64.shape[1]
    k64, v64 = k64.repeat_interleave(g, 1), v64.repeat_interleave(g, 1)
    s = (scale if scale is not None else 1 / math.sqrt(q.shape[-1])) * q64 @ k64.transpose(-1, -2)
    if mask is not None:
        s = s.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(s, -1)
    a = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
    return (a @ v64).transpose(1, 2).numpy(), lse.numpy()


# --- forward -------------------------------------------------------------------------------------


@pytest.mark.parametrize("T_q,T_k", [(7, 19), (19, 7), (16, 16), (1, 33)])
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_alignment_matches_explicit_boolean_mask(T_q, T_k, align):
    """SPEC 4.3: "bottom_right" (default) puts query t at t + T_k − T_q; "top_left" at t."""
    q, k, v = rand(2, T_q, 4, 16), rand(2, T_k, 2, 16), rand(2, T_k, 2, 16)
    out, lse = tm.attention_forward(q, k, v, align=align, return_lse=True)
    mask = causal_mask(T_q, T_k, align)
    ref_out, ref_lse = ref_attention(q, k, v, mask)
    assert_close(out, ref_out, FWD_ATOL, FWD_RTOL, "out")
    empty = ~mask.any(1).numpy()  # rows that see no key ("bottom_right" with T_q > T_k)
    assert (lse[:, :, empty] == -np.inf).all() and (out[:, empty] == 0).all()
    assert_close(lse[:, :, ~empty], ref_lse[:, :, ~empty], FWD_ATOL, FWD_RTOL, "lse")
    if align == "bottom_right" and T_q > T_k:
        assert empty.sum() == T_q - T_k


def test_default_alignment_is_bottom_right_and_non_causal_option():
    q, k, v = rand(1, 4, 2, 8), rand(1, 9, 2, 8), rand(1, 9, 2, 8)
    assert np.array_equal(tm.attention_forward(q, k, v),
                          tm.attention_forward(q, k, v, align="bottom_right"))
    out = tm.attention_forward(q, k, v, causal=False, scale=0.2)
    assert_close(out, ref_attention(q, k, v, None, 0.2)[0], FWD_ATOL, FWD_RTOL, "non-causal")


def test_zero_copy_output_into_callers_array_both_layouts():
    B, T, H, D = 2, 12, 4, 8
    q, k, v = rand(B, T, H, D), rand(B, T, H, D), rand(B, T, H, D)
    out = np.full((B, T, H, D), np.nan, np.float32)
    lse = np.full((B, H, T), np.nan, np.float32)
    got_out, got_lse = tm.attention_forward(q, k, v, out, lse)
    assert got_out is out and got_lse is lse and np.isfinite(out).all()
    ref_out, ref_lse = ref_attention(q, k, v, causal_mask(T, T, "bottom_right"))
    assert_close(out, ref_out, FWD_ATOL, FWD_RTOL, "out")
    assert_close(lse, ref_lse, FWD_ATOL, FWD_RTOL, "lse")

    # [B, H, T, D] arrays (PyTorch's layout) with layout="bhtd": transposed views, no copies.
    qt, kt, vt = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v))
    out_t = np.zeros((B, H, T, D), np.float32)
    assert tm.attention_forward(qt, kt, vt, out_t, layout="bhtd") is out_t
    assert np.allclose(out_t.transpose(0, 2, 1, 3), out, atol=1e-6)

    # A strided window of a larger caller buffer is written in place, the rest untouched.
    big = np.zeros((B, T, H + 2, D + 4), np.float32)
    window = big[:, :, 1 : H + 1, 2 : D + 2]
    tm.attention_forward(q, k, v, window)
    assert np.allclose(window, out, atol=1e-6)
    assert (big[:, :, 0] == 0).all() and (big[:, :, :, :2] == 0).all()


def test_torch_tensors_in_torch_out_and_caller_tensor_written():
    q = torch.randn(1, 6, 2, 8)
    out = tm.attention_forward(q, q, q)
    assert isinstance(out, torch.Tensor)
    buf = torch.zeros(1, 6, 2, 8)
    assert tm.attention_forward(q, q, q, out=buf) is buf and torch.equal(buf, out)
    # tensors that require grad are read through a detached view (no copy, no error)
    assert torch.equal(tm.attention_forward(q.requires_grad_(), q, q), out)


# --- backward ------------------------------------------------------------------------------------


@pytest.mark.parametrize("align,T_q,T_k", [("bottom_right", 9, 21), ("top_left", 21, 9),
                                           ("bottom_right", 17, 17)])
def test_backward_matches_torch_autograd(align, T_q, T_k):
    B, H_q, H_kv, D = 2, 6, 2, 12
    q, k, v = rand(B, T_q, H_q, D), rand(B, T_k, H_kv, D), rand(B, T_k, H_kv, D)
    dout = rand(B, T_q, H_q, D)
    out, lse = tm.attention_forward(q, k, v, align=align, scale=0.3, return_lse=True)
    dq, dk, dv = tm.attention_backward(q, k, v, out, lse, dout, align=align, scale=0.3)

    mask = causal_mask(T_q, T_k, align)
    tq, tk, tv = (torch.from_numpy(x).double().transpose(1, 2).requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(tq, tk, tv, attn_mask=mask, scale=0.3, enable_gqa=True)
    rows = mask.any(1)  # a row without a visible key: ours 0 (PyTorch 2.15 too; older ones NaN)
    ref = ref.nan_to_num(0.0)
    ref.backward(torch.from_numpy(dout).double().transpose(1, 2) * rows.view(1, 1, -1, 1))
    for ours, r in ((dq, tq.grad), (dk, tk.grad), (dv, tv.grad)):
        assert_close(ours, r.nan_to_num(0.0).transpose(1, 2), BWD_ATOL, BWD_RTOL, "grad")


# --- merge ---------------------------------------------------------------------------------------


def test_merge_partials_equals_attention_over_the_union():
    """Split the keys in two; merging the partial (O, L) gives attention over all keys."""
    B, T_q, T_k, H, D = 1, 5, 20, 3, 8
    q, k, v = rand(B, T_q, H, D), rand(B, T_k, H, D), rand(B, T_k, H, D)
    full, full_lse = tm.attention_forward(q, k, v, causal=False, return_lse=True)
    o1, l1 = tm.attention_forward(q, k[:, :8], v[:, :8], causal=False, return_lse=True)
    o2, l2 = tm.attention_forward(q, k[:, 8:], v[:, 8:], causal=False, return_lse=True)
    out, lse = tm.merge_partials(o1, l1, o2, l2)
    assert np.allclose(out, full, atol=1e-5) and np.allclose(lse, full_lse, atol=1e-5)
    # in place into o1/lse1
    tm.merge_partials(o1, l1, o2, l2, out=o1, lse_out=l1)
    assert np.allclose(o1, full, atol=1e-5)


# --- RoPE ----------------------------------------------------------------------------------------


def ref_rope(x, pairing, base, offset):
    B, T, H, D = x.shape
    theta = base ** (-2.0 * np.arange(D // 2) / D)
    phi = (offset + np.arange(T))[:, None] * theta[None, :]  # [T, D/2]
    cos, sin = np.cos(phi)[None, :, None, :], np.sin(phi)[None, :, None, :]
    x = x.astype(np.float64)
    if pairing == "rotate_half":
        a, b = x[..., : D // 2], x[..., D // 2 :]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], -1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


@pytest.mark.parametrize("pairing", ["rotate_half", "interleaved"])
def test_rope_forward_and_inverse(pairing):
    x = rand(2, 9, 3, 16)
    y = x.copy()
    assert tm.rope_forward(y, pairing=pairing, base=500000.0, position_offset=4) is y
    assert np.allclose(y, ref_rope(x, pairing, 500000.0, 4), atol=1e-5)
    tm.rope_backward(y, pairing=pairing, base=500000.0, position_offset=4)
    assert np.allclose(y, x, atol=1e-5)
    # bhtd layout, in place on a transposed view
    xt = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
    tm.rope_forward(xt, pairing=pairing, base=500000.0, position_offset=4, layout="bhtd")
    assert np.allclose(xt.transpose(0, 2, 1, 3), ref_rope(x, pairing, 500000.0, 4), atol=1e-5)


def test_rope_rejects_odd_width():
    with pytest.raises(tm.ArgumentError):
        tm.rope_forward(rand(1, 2, 1, 5))


# --- softmax and its Jacobian (SPEC 4.4, 4.6–4.7) -----------------------------------------------


def test_softmax_logsumexp_and_masking():
    z = rand(3, 4, 11)
    z[0, 0, 3] = -np.inf
    z[1, 2, :] = -np.inf  # all masked: zeros, not NaN
    a = tm.softmax(z)
    ref = torch.softmax(torch.from_numpy(z).double(), -1).nan_to_num(0.0).numpy()
    assert np.allclose(a, ref, atol=1e-6) and a[0, 0, 3] == 0 and (a[1, 2] == 0).all()
    row = rand(50)
    assert math.isclose(tm.logsumexp(row), torch.logsumexp(torch.from_numpy(row).double(), 0).item(),
                        rel_tol=1e-6)
    assert tm.logsumexp(np.full(4, -np.inf, np.float32)) == -np.inf
    out = np.empty_like(z)
    assert tm.softmax(z, out) is out


def test_softmax_jacobian_properties_and_product():
    a = tm.softmax(rand(9))
    J = tm.softmax_jacobian(a).astype(np.float64)
    ref = np.diag(a) - np.outer(a, a)
    assert np.allclose(J, ref, atol=1e-7)
    assert np.allclose(J, J.T, atol=0)  # symmetric
    assert np.abs(J @ np.ones(9)).max() < 1e-6  # shift invariance
    assert np.linalg.eigvalsh(J).min() > -1e-6  # positive semidefinite
    g = rand(9)
    jg = tm.softmax_jacobian_vector_product(a, g)
    assert np.allclose(jg, J @ g, atol=1e-6)
    # matches autograd's vector-Jacobian product of torch.softmax
    z = torch.randn(9, dtype=torch.float64, requires_grad=True)
    torch.softmax(z, 0).backward(torch.from_numpy(g).double())
    a64 = torch.softmax(z.detach(), 0).float().numpy()
    assert np.allclose(tm.softmax_jacobian_vector_product(a64, g), z.grad.numpy(), atol=1e-6)


# --- errors --------------------------------------------------------------------------------------


def test_errors():
    q = rand(1, 4, 2, 8)
    with pytest.raises(TypeError, match="q has dtype float64"):
        tm.attention_forward(q.astype(np.float64), q, q)
    with pytest.raises(TypeError, match="v has dtype float16"):
        tm.attention_forward(q, q, q.astype(np.float16))
    with pytest.raises(TypeError, match="numpy.ndarray or a torch.Tensor"):
        tm.attention_forward(q.tolist(), q, q)
    with pytest.raises(ValueError, match="4 dimensions"):
        tm.attention_forward(q[0], q, q)
    with pytest.raises(tm.ArgumentError, match="H_kv") as e:
        tm.attention_forward(q, rand(1, 4, 3, 8), rand(1, 4, 3, 8))
    assert isinstance(e.value, ValueError) and e.value.code == "shape_mismatch"
    with pytest.raises(tm.ArgumentError) as e:
        tm.attention_forward(q, q, q, out=q)  # output overlaps an input
    assert e.value.code == "aliasing"
    with pytest.raises(tm.ArgumentError) as e:
        tm.attention_forward(q, q, q, scale=float("nan"))
    assert e.value.code == "invalid_argument"
    with pytest.raises(tm.ArgumentError, match="strides"):
        tm.attention_forward(q[:, ::-1], q, q)  # negative strides are rejected, not copied
    ro = np.zeros_like(q)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        tm.attention_forward(q, q, q, out=ro)
    with pytest.raises(ValueError, match="align"):
        tm.attention_forward(q, q, q, align="middle")
    with pytest.raises(ValueError, match="layout"):
        tm.attention_forward(q, q, q, layout="tbhd")
    with pytest.raises(tm.ArgumentError, match="isa"):
        tm.attention_forward(q, q, q, isa="sse9")
    missing = [i for i in ("avx2", "avx512", "neon") if i not in tm.available_isas()]
    for isa in missing:  # a path this CPU lacks: NotImplementedError, never a crash
        with pytest.raises(NotImplementedError):
            tm.attention_forward(q, q, q, isa=isa)
    assert issubclass(tm.UnsupportedError, NotImplementedError)


def test_every_available_isa_gives_the_same_answer():
    q, k, v = rand(1, 70, 4, 32), rand(1, 70, 2, 32), rand(1, 70, 2, 32)
    ref = ref_attention(q, k, v, causal_mask(70, 70, "bottom_right"))[0]
    for isa in tm.available_isas():
        assert_close(tm.attention_forward(q, k, v, isa=isa), ref, FWD_ATOL, FWD_RTOL, isa)
    assert tm.resolve_isa() in tm.available_isas()
    assert set(tm.cpu_features()) >= {"model", "avx2_fma", "avx512f", "neon", "flags"}


def test_gil_is_released_during_compute():
    """Another Python thread keeps running while attention computes."""
    q, k, v = rand(1, 1024, 8, 64), rand(1, 1024, 8, 64), rand(1, 1024, 8, 64)
    ticks = 0
    stop = threading.Event()

    def counter():
        nonlocal ticks
        while not stop.is_set():
            ticks += 1
            time.sleep(0)

    t = threading.Thread(target=counter)
    t.start()
    time.sleep(0.01)
    before = ticks
    start = time.perf_counter()
    tm.attention_forward(q, k, v, threads=1)
    elapsed = time.perf_counter() - start
    during = ticks - before
    stop.set()
    t.join()
    assert elapsed > 0.005 and during > 10, (elapsed, during)


def test_concurrent_calls_from_threads_agree():
    q, k, v = rand(1, 200, 4, 32), rand(1, 200, 4, 32), rand(1, 200, 4, 32)
    expected = tm.attention_forward(q, k, v)
    results = [None] * 4

    def work(i):
        results[i] = tm.attention_forward(q, k, v, threads=1)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(np.array_equal(r, expected) for r in results)


def test_useful_work_counts():
    assert tm.visible_pairs(8, 8) == 36
    assert tm.visible_keys(0, 4, 10) == 7  # "bottom_right": query 0 is at position 6
    assert tm.visible_keys(0, 4, 10, align="top_left") == 1
    assert tm.forward_flops(1, 8, 8, 2, 16) == 4 * 16 * 2 * 36
    assert tm.kv_cache_bytes(2, 1, 10, 2, 8, 4) == 2 * 2 * 1 * 10 * 2 * 8 * 4


# --- KV cache and decode -------------------------------------------------------------------------


@pytest.mark.parametrize("block_tokens", [0, 64])
def test_kv_cache_decode_equals_attention_forward(block_tokens):
    B, T, T_new, H_q, H_kv, D = 2, 70, 3, 4, 2, 16
    k, v = rand(B, T, H_kv, D), rand(B, T, H_kv, D)
    q = rand(B, T_new, H_q, D)
    cache = tm.KVCache(layers=2, batch=B, heads_kv=H_kv, head_dim=D, capacity=128,
                       block_tokens=block_tokens)
    assert cache.paged == (block_tokens != 0)
    cache.append(1, k[:, : T - T_new], v[:, : T - T_new])
    cache.append(1, k[:, T - T_new :], v[:, T - T_new :])
    assert cache.length(0, 1) == T and cache.length(0, 0) == 0
    out, lse = tm.attention_decode(q, cache, 1, return_lse=True)
    ref_out, ref_lse = tm.attention_forward(q, k, v, return_lse=True)  # "bottom_right"
    assert np.allclose(out, ref_out, atol=2e-5) and np.allclose(lse, ref_lse, atol=2e-5)
    # bhtd layout for q/out
    out_t = tm.attention_decode(np.ascontiguousarray(q.transpose(0, 2, 1, 3)), cache, 1,
                                layout="bhtd")
    assert np.allclose(out_t.transpose(0, 2, 1, 3), out, atol=1e-6)
    assert cache.decode_bytes(1, 0, B) == 2 * B * T * H_kv * D * 4


def test_kv_cache_errors_leave_cache_unchanged_and_bf16():
    cache = tm.KVCache(1, 1, 2, 8, 16, dtype="bf16")
    assert cache.dtype == "bf16"
    k = rand(1, 4, 2, 8)
    cache.append(0, k, k)
    before = cache.length(0)
    with pytest.raises(tm.ArgumentError):
        cache.append(0, rand(1, 20, 2, 8), rand(1, 20, 2, 8))  # past capacity
    with pytest.raises(tm.ArgumentError):
        cache.append(0, rand(1, 1, 3, 8), rand(1, 1, 3, 8))  # wrong H_kv
    assert cache.length(0) == before
    q = rand(1, 1, 4, 8)
    out = tm.attention_decode(q, cache, 0)
    ref = tm.attention_forward(q, k, k)
    assert np.allclose(out, ref, atol=3e-2)  # bf16 storage: ~3 significant digits
    cache.truncate(0, 2)
    assert cache.length(0) == 2
    cache.reset()
    assert cache.length(0) == 0
    with pytest.raises(ValueError, match="dtype"):
        tm.KVCache(1, 1, 2, 8, 16, dtype="int4")  # int8 and fp8_e4m3 exist (issue 15)
