"""NaN propagation through the NumPy API and the torch drop-in (SPEC 4.3; docs/design.md
"Numerics"): a NaN a row reads makes that row NaN, as PyTorch's math says; a key a row does not
see never reaches it (masking selects, it never multiplies), so earlier rows are bitwise what
they are without it. Yardstick: PyTorch in float64 — its SDPA math backend, or on inputs without
the NaN key for the rows that do not see it. (PyTorch's fused CPU SDPA is not the yardstick here:
for a NaN q row it returns zeros, and a NaN in v reaches rows that do not see that key.)

Shapes straddle the 64-key tiles (T = 150, the NaN key at 70, inside a tile that crosses the
diagonal), GQA (H_q = 4, H_kv = 2), an odd head width (d_h = 24 + 1), every kernel path.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import tokenmix as tm
import tokenmix.torch as tmt
from conftest import FWD_ATOL, FWD_RTOL, assert_close

B, T, H_Q, H_KV, D = 1, 150, 4, 2, 25
U = 70  # the position of the NaN key (query t < U does not see it)
NAN = float("nan")


def rand(*shape):
    return np.random.standard_normal(shape).astype(np.float32)


def torch_math(q, k, v, causal=True):
    """float64 PyTorch SDPA, math backend, on [B, T, H, D] NumPy arrays; returns [B, T, H, D]."""
    q64, k64, v64 = (torch.from_numpy(x).double().transpose(1, 2) for x in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2).numpy()


def assert_same_nans_and_close(ours, ref, what):
    ours, ref = np.asarray(ours), np.asarray(ref)
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(ref), err_msg=what + ": NaN pattern")
    finite = ~np.isnan(ref)
    assert np.isfinite(ours[finite]).all(), what
    assert_close(ours[finite], ref[finite], FWD_ATOL, FWD_RTOL, what)


@pytest.mark.parametrize("isa", tm.available_isas())
@pytest.mark.parametrize("align", ["bottom_right", "top_left"])
def test_nan_in_a_query_row_makes_that_row_nan_only(isa, align):
    q, k, v = rand(B, T, H_Q, D), rand(B, T, H_KV, D), rand(B, T, H_KV, D)
    q[0, 3, 1, 7] = NAN  # row t = 3 of head 1 (a row of the first tile)
    q[0, 100, 2, 0] = NAN  # row t = 100 of head 2 (a later tile, the other KV head's group)
    out, lse = tm.attention_forward(q, k, v, align=align, isa=isa, return_lse=True)
    ref = torch_math(q, k, v)  # T_q == T_k: both alignments are PyTorch's is_causal
    assert np.isnan(ref[0, 3, 1]).all() and np.isnan(ref[0, 100, 2]).all()
    assert np.isfinite(np.delete(ref.reshape(T * H_Q, D), [3 * H_Q + 1, 100 * H_Q + 2], 0)).all()
    assert_same_nans_and_close(out, ref, f"out ({isa})")
    assert np.isnan(lse[0, 1, 3]) and np.isnan(lse[0, 2, 100])
    lse_clean = lse.copy()
    lse_clean[0, 1, 3] = lse_clean[0, 2, 100] = 0.0
    assert np.isfinite(lse_clean).all()


@pytest.mark.parametrize("isa", tm.available_isas())
@pytest.mark.parametrize("where", ["k", "v"])
def test_nan_in_a_future_key_leaves_earlier_rows_unaffected(isa, where):
    q, k, v = rand(B, T, H_Q, D), rand(B, T, H_KV, D), rand(B, T, H_KV, D)
    clean_out, clean_lse = tm.attention_forward(q, k, v, isa=isa, return_lse=True)
    poisoned = {"k": k.copy(), "v": v.copy()}
    poisoned[where][0, U, 1, 5] = NAN  # KV head 1: query heads 2 and 3 read it
    out, lse = tm.attention_forward(q, poisoned["k"], poisoned["v"], isa=isa, return_lse=True)

    # Rows t < U do not see key U: bitwise as without the NaN, and equal to PyTorch's math on the
    # keys they see (the first U).
    np.testing.assert_array_equal(out[:, :U], clean_out[:, :U])
    np.testing.assert_array_equal(lse[:, :, :U], clean_lse[:, :, :U])
    ref_early = torch_math(q[:, :U], k[:, :U], v[:, :U])
    assert_close(out[:, :U], ref_early, FWD_ATOL, FWD_RTOL, "rows before the NaN key")
    # Query heads 0 and 1 read KV head 0 only: untouched everywhere.
    np.testing.assert_array_equal(out[:, :, :2], clean_out[:, :, :2])

    late = out[:, U:, 2:]  # rows that see the NaN key, heads of KV head 1
    if where == "k":  # a NaN score: the whole row and its L are NaN
        assert np.isnan(late).all() and np.isnan(lse[:, 2:, U:]).all()
    else:  # a NaN in v[U][5]: column 5 of those rows only; the weights (and L) are unchanged
        assert np.isnan(late[..., 5]).all()
        np.testing.assert_array_equal(lse, clean_lse)
        assert_close(np.delete(late, 5, -1), np.delete(clean_out[:, U:, 2:], 5, -1), FWD_ATOL,
                     FWD_RTOL,
                     "other columns")


def test_softmax_of_minus_inf_and_nan_is_nan_like_torch():
    z = np.array([[-math.inf, NAN], [-math.inf, 0.0], [NAN, 1.0], [-math.inf, -math.inf]],
                 np.float32)
    ours = tm.softmax(z)
    ref = torch.softmax(torch.from_numpy(z).double(), -1).numpy()
    assert np.isnan(ours[0]).all() and np.isnan(ref[0]).all()  # softmax([-inf, nan]) = [nan, nan]
    np.testing.assert_array_equal(ours[1], [0.0, 1.0])
    assert np.isnan(ours[2]).all() and np.isnan(ref[2]).all()
    np.testing.assert_array_equal(ours[3], [0.0, 0.0])  # tokenmix: an all −inf row gives zeros
    assert math.isnan(tm.logsumexp(z[0]))
    torch_in = torch.from_numpy(z[0].copy())
    assert torch.isnan(tm.softmax(torch_in)).all()


# --- the torch drop-in ----------------------------------------------------------------------------


def bhtd(*shape):
    return torch.randn(*shape)


def test_drop_in_nan_query_row_matches_torch_math():
    q, k, v = bhtd(B, H_Q, T, D), bhtd(B, H_KV, T, D), bhtd(B, H_KV, T, D)
    q[0, 1, 3, 7] = NAN
    out = tmt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True,
                                             enable_gqa=True)
    assert torch.isnan(out[0, 1, 3]).all()
    assert_same_nans_and_close(out.numpy(), ref.numpy(), "drop-in out")


@pytest.mark.parametrize("where", ["key", "value"])
def test_drop_in_nan_future_key_leaves_earlier_rows_unaffected(where):
    q, k, v = bhtd(B, H_Q, T, D), bhtd(B, H_KV, T, D), bhtd(B, H_KV, T, D)
    clean = tmt.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    k2, v2 = k.clone(), v.clone()
    (k2 if where == "key" else v2)[0, 0, U, 3] = NAN
    out = tmt.scaled_dot_product_attention(q, k2, v2, is_causal=True, enable_gqa=True)
    assert torch.equal(out[:, :, :U], clean[:, :, :U])
    with sdpa_kernel(SDPBackend.MATH):
        ref = F.scaled_dot_product_attention(q[:, :, :U].double(), k[:, :, :U].double(),
                                             v[:, :, :U].double(), is_causal=True,
                                             enable_gqa=True)
    assert_close(out[:, :, :U], ref, FWD_ATOL, FWD_RTOL, "drop-in rows before the NaN key")
    late = out[0, :2, U:]  # query heads 0 and 1 read KV head 0
    assert torch.isnan(late).all() if where == "key" else torch.isnan(late[..., 3]).all()
    assert torch.equal(out[:, 2:], clean[:, 2:])
