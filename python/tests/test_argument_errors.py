"""Arguments the native extension cannot take as they are (issue 11): each raises the documented
error — TypeError for a dtype other than native-endian float32, tokenmix.ArgumentError (a
ValueError with a ``code``) for invalid values — whose message names the entry point and the
argument, what was expected and what was given; never nanobind's generic "incompatible function
arguments". Outputs are left untouched by a rejected call."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import tokenmix as tm
import tokenmix._tokenmix as _C

# float32 in the byte order this machine does not use ('>f4' on x86), and the one it does.
NON_NATIVE_F32 = np.dtype(np.float32).newbyteorder()
NATIVE_F32 = np.dtype(np.float32).str


def rand(*shape, dtype=np.float32):
    return np.random.standard_normal(shape).astype(dtype)


def odd_stride_view(shape):
    """A float32 view whose last axis has a byte stride of 6: field "x" of a packed record
    (float32 + int16), e.g. read from a binary file. No tokenmix view can address it."""
    rec = np.zeros(shape, dtype=[("x", "<f4"), ("pad", "<i2")])
    rec["x"] = rand(*shape)
    view = rec["x"]
    assert view.strides[-1] == 6 and view.dtype == np.float32
    return view


def no_incompatible(excinfo):
    assert "incompatible function arguments" not in str(excinfo.value)


Q = (1, 5, 4, 8)  # [B, T, H_q, d_h]
KV = (1, 5, 2, 8)  # [B, T, H_kv, d_h]


def cases(bad):
    """(entry point, argument, call) for one bad array `bad(shape)` in each binding area."""
    cache = tm.KVCache(layers=1, batch=1, heads_kv=2, head_dim=8, capacity=16)
    cache.append(0, rand(*KV), rand(*KV))
    layer = tm.CausalSelfAttention(16, 2, seed=1)
    q, k, v = rand(*Q), rand(*KV), rand(*KV)
    out, lse = tm.attention_forward(q, k, v, return_lse=True)
    return [
        ("attention_forward", "q", lambda: tm.attention_forward(bad(Q), k, v)),
        ("attention_forward", "v", lambda: tm.attention_forward(q, k, bad(KV))),
        ("attention_forward", "out", lambda: tm.attention_forward(q, k, v, out=bad(Q))),
        ("attention_backward", "dout",
         lambda: tm.attention_backward(q, k, v, out, lse, bad(Q))),
        ("merge_partials", "o2", lambda: tm.merge_partials(out, lse, bad(Q), lse)),
        ("rope_forward", "x", lambda: tm.rope_forward(bad(Q))),
        ("KVCache.append", "k", lambda: cache.append(0, bad(KV), rand(*KV))),
        ("attention_decode", "q", lambda: tm.attention_decode(bad((1, 1, 4, 8)), cache, 0)),
        ("attention_decode", "out",
         lambda: tm.attention_decode(rand(1, 1, 4, 8), cache, 0, out=bad((1, 1, 4, 8)))),
        ("CausalSelfAttention.forward", "out", lambda: layer.forward(rand(1, 3, 16),
                                                                     out=bad((1, 3, 16)))),
    ]


@pytest.mark.parametrize("index", range(10))
def test_non_native_byte_order_is_a_type_error_naming_the_argument(index):
    def bad(shape):
        return np.zeros(shape, NON_NATIVE_F32)

    fn, name, call = cases(bad)[index]
    with pytest.raises(TypeError) as e:
        call()
    no_incompatible(e)
    msg = str(e.value)
    assert msg.startswith(f"{fn}: {name} has dtype '{NON_NATIVE_F32.str}'"), msg
    assert f"expected native-endian float32 ('{NATIVE_F32}')" in msg, msg


def test_non_native_byte_order_in_the_span_based_operations():
    """softmax and the layer take C-contiguous arrays; the byte order is checked all the same."""
    z = np.zeros((3, 4), NON_NATIVE_F32)
    with pytest.raises(TypeError, match=f"z has dtype '{re.escape(NON_NATIVE_F32.str)}'"):
        tm.softmax(z)
    with pytest.raises(TypeError, match=f"z has dtype '{re.escape(NON_NATIVE_F32.str)}'"):
        tm.logsumexp(np.zeros(4, NON_NATIVE_F32))
    layer = tm.CausalSelfAttention(16, 2, seed=1)
    with pytest.raises(TypeError, match=r"^CausalSelfAttention\.forward: u has dtype '"):
        layer.forward(np.zeros((1, 3, 16), NON_NATIVE_F32))
    # The same values in native order are computed (the error is about the order, not values).
    assert np.allclose(tm.softmax(z.astype(np.float32)), 0.25)


@pytest.mark.parametrize("index", [i for i in range(10) if i != 9])  # 9: the layer copies u
def test_byte_stride_not_a_multiple_of_4_is_an_argument_error_naming_it(index):
    fn, name, call = cases(odd_stride_view)[index]
    with pytest.raises(tm.ArgumentError) as e:
        call()
    no_incompatible(e)
    assert e.value.code == "invalid_argument" and isinstance(e.value, ValueError)
    msg = str(e.value)
    assert msg.startswith(f"{fn}: {name} has a byte stride of 6, not a multiple of its element "
                          "size (4 bytes"), msg


def test_odd_byte_stride_output_is_left_untouched_and_bhtd_layout_named():
    q, k, v = rand(*Q), rand(*KV), rand(*KV)
    out = odd_stride_view(Q)
    before = out.copy()
    with pytest.raises(tm.ArgumentError, match=r"^attention_forward: out has a byte stride of 6"):
        tm.attention_forward(q, k, v, out=out)
    assert np.array_equal(out, before)
    # layout="bhtd": the view handed to the extension is transposed; the stride is still named.
    qt = np.ascontiguousarray(q.transpose(0, 2, 1, 3))
    with pytest.raises(tm.ArgumentError, match=r"^attention_forward: q has a byte stride of 6"):
        tm.attention_forward(odd_stride_view((1, 4, 5, 8)), qt, qt, layout="bhtd")


THREADS = [2**31, 2**64, -1]


@pytest.mark.parametrize("threads", THREADS)
def test_threads_out_of_range_is_an_argument_error_naming_threads(threads):
    q, k, v = rand(*Q), rand(*KV), rand(*KV)
    out = np.full(Q, np.nan, np.float32)
    _, lse = tm.attention_forward(q, k, v, return_lse=True)
    cache = tm.KVCache(1, 1, 2, 8, 16)
    cache.append(0, k, v)
    calls = [
        ("attention_forward", lambda: tm.attention_forward(q, k, v, out=out, threads=threads)),
        ("attention_backward",
         lambda: tm.attention_backward(q, k, v, q, lse, q, threads=threads)),
        ("attention_decode",
         lambda: tm.attention_decode(rand(1, 1, 4, 8), cache, 0, threads=threads)),
        ("CausalSelfAttention", lambda: tm.CausalSelfAttention(16, 2, threads=threads)),
    ]
    for fn, call in calls:
        with pytest.raises(tm.ArgumentError) as e:
            call()
        no_incompatible(e)
        assert e.value.code == "invalid_argument"
        assert str(e.value) == f"{fn}: threads must be in [0, 2147483647] (0 = all); got {threads}"
    assert np.isnan(out).all()  # rejected before anything was written


def test_threads_of_other_integer_types_and_non_integers():
    q = rand(*Q)
    expected = tm.attention_forward(q, q, q, threads=1)
    assert np.array_equal(tm.attention_forward(q, q, q, threads=np.int64(1)), expected)
    assert np.array_equal(tm.attention_forward(q, q, q, threads=np.uint8(1)), expected)
    with pytest.raises(tm.ArgumentError, match=r"^attention_forward: threads .*; got 4294967296$"):
        tm.attention_forward(q, q, q, threads=np.int64(2**32))
    with pytest.raises(TypeError, match=r"^attention_forward: threads must be an integer; got "
                                        r"float$"):
        tm.attention_forward(q, q, q, threads=2.0)


def test_other_numpy_dtypes_name_the_dtype():
    q = rand(*Q)
    # The attention tensors may be float32, bfloat16 or float16 (SPEC "Reduced precision").
    for dtype in (object, np.complex64, np.int32, np.float64):
        with pytest.raises(TypeError, match=r"^attention_forward: k has dtype "
                                            rf"{re.escape(str(np.dtype(dtype)))}; expected "
                                            r"float32, bfloat16 .* or float16"):
            tm.attention_forward(q, q.astype(dtype), q)
    # float16 is one of them, but not mixed with float32 q.
    with pytest.raises(TypeError, match=r"^attention_forward: k has dtype float16 but q has "
                                        r"float32; q, k, v and out must have one dtype"):
        tm.attention_forward(q, q.astype("<f2"), q)
    # Other functions stay float32 only.
    with pytest.raises(TypeError, match=r"^rope_forward: x has dtype float16; tokenmix computes "
                                        r"in float32 only"):
        tm.rope_forward(q.astype("<f2"))


def test_extension_called_directly_names_function_and_argument():
    """The private extension gives the same errors (the package's checks are not the only ones)."""
    q = rand(*Q)
    args = (None, None, True, "bottom_right", 0, "auto")  # lse, scale, causal, align, threads, isa
    with pytest.raises(TypeError, match=r"^attention_forward: k must be a numpy\.ndarray or a "
                                        r"torch\.Tensor .*; got list$"):
        _C.attention_forward(q, q.tolist(), q, np.empty_like(q), *args)
    read_only = np.zeros_like(q)
    read_only.flags.writeable = False
    with pytest.raises(ValueError, match=r"^attention_forward: out is read-only"):
        _C.attention_forward(q, q, q, read_only, *args)
    # A tensor DLPack cannot export (sparse): the reason is PyTorch's own.
    sparse = torch.from_numpy(q).to_sparse()
    with pytest.raises(TypeError, match=r"^attention_forward: q \(torch\.Tensor\) cannot be "
                                        r"passed without a copy: .*layout"):
        tm.attention_forward(sparse, q, q)
    with pytest.raises(TypeError, match=r"^attention_forward: q has dtype float64"):
        _C.attention_forward(q.astype(np.float64), q, q, np.empty_like(q), *args)
