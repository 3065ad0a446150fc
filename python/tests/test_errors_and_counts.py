"""The library's newer error kinds as Python sees them: tokenmix.ResourceError (kernel scratch
that cannot be allocated), the one alignment parser (tokenmix::parse_causal_align) behind every
``align=``, the useful-work counts' ArgumentErrors (invalid_argument, overflow) and
backward_flops, and the TOKENMIX_CPU_CAP cap (cpu_cap)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import numpy as np
import pytest

import tokenmix as tm
import tokenmix._tokenmix as _C

# --- ResourceError: a head width whose kernel scratch cannot exist ------------------------------

D_HUGE = 1 << 40  # d_h = 2^40: tens of TiB of per-worker scratch on every kernel path


class NoAccessRange:
    """`n` float32 of reserved, inaccessible address space (PROT_NONE, MAP_NORESERVE: no memory
    behind it), as NumPy arrays. A write would fault, so a test that passes shows that the
    library rejected the call before touching its outputs."""

    def __init__(self, n: int):
        self.libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.libc.mmap.restype = ctypes.c_void_p
        self.libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                                   ctypes.c_int, ctypes.c_long]
        self.libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.bytes = 4 * n
        prot_none = 0  # PROT_NONE (Linux); Python's mmap module does not name it
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_NORESERVE", 0x4000)
        addr = self.libc.mmap(None, self.bytes, prot_none, flags, -1, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), (
            f"mmap(PROT_NONE) of {self.bytes} bytes failed: errno {ctypes.get_errno()}")
        self.addr = addr

    def array(self, offset: int, shape: tuple) -> np.ndarray:
        """A writable, C-contiguous float32 array of `shape` at float `offset` of the range."""
        holder = type("Holder", (), {})()
        holder.__array_interface__ = {"shape": shape, "typestr": np.dtype(np.float32).str,
                                      "data": (self.addr + 4 * offset, False), "version": 3}
        a = np.asarray(holder)
        assert a.flags.writeable and a.flags.c_contiguous
        return a

    def close(self) -> None:
        self.libc.munmap(self.addr, self.bytes)


def broadcast_input(value: float, shape: tuple) -> np.ndarray:
    """One float seen as an array of `shape` with all strides 0 (a valid input view)."""
    return np.lib.stride_tricks.as_strided(np.array([value], np.float32), shape, (0,) * len(shape))


@pytest.mark.parametrize("isa", tm.available_isas())
def test_unallocatable_scratch_is_a_resource_error(isa):
    """SPEC "Useful-work counts" aside, nothing in the maths bounds d_h: q, k, v of d_h = 2^40
    (zero-stride views of one float) are valid, and the kernel's scratch for them cannot be
    allocated. That is a tokenmix.ResourceError (a MemoryError, code "out_of_memory") naming the
    entry point, the kernel and the bytes — and nothing has been written (a write would fault)."""
    shape = (1, 1, 1, D_HUGE)
    q, k, v = (broadcast_input(x, shape) for x in (0.5, 0.25, 1.0))
    no_access = NoAccessRange(3 * D_HUGE)
    try:
        out = no_access.array(0, shape)
        lse = np.full((1, 1, 1), np.nan, np.float32)
        with pytest.raises(tm.ResourceError) as e:
            tm.attention_forward(q, k, v, out=out, lse=lse, isa=isa)
        assert isinstance(e.value, MemoryError) and e.value.code == "out_of_memory"
        msg = str(e.value)
        # (the avx512_bf16 path runs the avx512 kernels on float32: dispatch/registry.cpp)
        kname = "avx512" if isa == "avx512_bf16" else isa
        assert msg.startswith("attention_forward: ") and f"attention_fwd_f32_{kname}" in msg, msg
        assert "bytes" in msg, msg
        assert np.isnan(lse).all()  # untouched

        dout = broadcast_input(1.0, shape)
        dq, dk, dv = (no_access.array(i * D_HUGE, shape) for i in range(3))
        with pytest.raises(tm.ResourceError) as e:
            tm.attention_backward(q, k, v, q, lse, dout, dq, dk, dv, isa=isa)
        assert e.value.code == "out_of_memory"
        assert str(e.value).startswith("attention_backward: ")
        assert f"attention_bwd_f32_{kname}" in str(e.value)
    finally:
        no_access.close()


def test_resource_error_type():
    assert tm.ResourceError is _C.ResourceError and issubclass(tm.ResourceError, MemoryError)
    assert not issubclass(tm.ResourceError, tm.ArgumentError)
    assert f"{tm.ResourceError.__module__}.{tm.ResourceError.__name__}" == "tokenmix.ResourceError"


# --- align: one spelling, one parser ------------------------------------------------------------

BAD_ALIGNS = ["middle", "Bottom_Right", "bottom-right", "", "top_left "]


@pytest.mark.parametrize("align", BAD_ALIGNS)
def test_bad_align_is_an_argument_error_naming_entry_point_and_spellings(align):
    q = np.zeros((1, 3, 2, 4), np.float32)
    out = np.full_like(q, np.nan)
    calls = [
        ("attention_forward", lambda: tm.attention_forward(q, q, q, out=out, align=align)),
        ("attention_backward",
         lambda: tm.attention_backward(q, q, q, q, np.zeros((1, 2, 3), np.float32), q,
                                       align=align)),
        ("visible_keys", lambda: tm.visible_keys(0, 3, 3, align=align)),
        ("visible_pairs", lambda: tm.visible_pairs(3, 3, align=align)),
        ("forward_flops", lambda: tm.forward_flops(1, 3, 3, 2, 4, align=align)),
        ("backward_flops", lambda: tm.backward_flops(1, 3, 3, 2, 4, align=align)),
    ]
    for fn, call in calls:
        with pytest.raises(tm.ArgumentError) as e:
            call()
        assert isinstance(e.value, ValueError) and e.value.code == "invalid_argument"
        assert str(e.value) == (f"{fn}: align must be one of bottom_right, top_left; "
                                f"got '{align}'"), fn
    assert np.isnan(out).all()


def test_both_spellings_are_accepted_everywhere():
    for align in ("bottom_right", "top_left"):
        assert tm.visible_pairs(3, 5, align=align) > 0
    assert tm.visible_pairs(3, 5, align="bottom_right") == 3 + 4 + 5
    assert tm.visible_pairs(3, 5, align="top_left") == 1 + 2 + 3
    assert tm.visible_pairs(5, 3, align="bottom_right") == 0 + 0 + 1 + 2 + 3


# --- the useful-work counts' errors and backward_flops ------------------------------------------


def test_visible_pairs_overflow_is_an_argument_error_with_code_overflow():
    T = 6 * 2**30  # causal P = T(T+1)/2 ≈ 2.1e19 > 2^63 − 1
    with pytest.raises(tm.ArgumentError) as e:
        tm.visible_pairs(T, T)
    assert e.value.code == "overflow" and isinstance(e.value, ValueError)
    msg = str(e.value)
    assert msg.startswith("visible_pairs: ") and f"T_q = {T}" in msg and f"T_k = {T}" in msg, msg
    assert "2^63 - 1" in msg, msg
    # One below the limit is exact: the largest causal T with T(T+1)/2 ≤ 2^63 − 1.
    T_ok = 4294967295  # 2^32 − 1: P = 2^63 − 2^31
    assert tm.visible_pairs(T_ok, T_ok) == T_ok * (T_ok + 1) // 2
    # The FLOP counts are doubles: the same sizes do not overflow there.
    assert tm.forward_flops(1, T, T, 1, 1) == pytest.approx(4.0 * T * (T + 1) / 2, rel=1e-15)


def test_count_arguments_out_of_range_are_argument_errors():
    cases = [
        ("visible_keys", lambda: tm.visible_keys(4, 4, 4), "t must be in [0, T_q = 4); got 4"),
        ("visible_keys", lambda: tm.visible_keys(-1, 4, 4), "got -1"),
        ("visible_pairs", lambda: tm.visible_pairs(-1, 4), "T_q must be >= 0; got -1"),
        ("forward_flops", lambda: tm.forward_flops(-2, 4, 4, 1, 1), "B must be >= 0; got -2"),
        ("forward_flops", lambda: tm.forward_flops(1, 4, 4, 1, -3), "d_h must be >= 0; got -3"),
    ]
    for fn, call, text in cases:
        with pytest.raises(tm.ArgumentError) as e:
            call()
        assert e.value.code == "invalid_argument", fn
        assert str(e.value).startswith(fn + ": ") and text in str(e.value), str(e.value)
    # backward_flops validates as forward_flops does (it is 2.5 × that count).
    with pytest.raises(tm.ArgumentError) as e:
        tm.backward_flops(1, 4, 4, -1, 8)
    assert e.value.code == "invalid_argument" and "H_q must be >= 0; got -1" in str(e.value)


def test_count_sizes_of_any_integer_type_beyond_int64_and_non_integers():
    """Sizes are converted in the binding, which names the function and the argument (never
    nanobind's "incompatible function arguments")."""
    assert tm.visible_pairs(np.int64(8), np.uint16(8)) == 36
    assert tm.backward_flops(np.int32(1), 8, 8, 2, np.int8(16)) == 2.5 * 4 * 16 * 2 * 36
    for fn, call, name, value in [
        ("visible_pairs", lambda: tm.visible_pairs(2**70, 3), "T_q", 2**70),
        ("visible_keys", lambda: tm.visible_keys(0, 3, -(2**63) - 1), "T_k", -(2**63) - 1),
        ("forward_flops", lambda: tm.forward_flops(2**64, 3, 3, 1, 1), "B", 2**64),
        ("backward_flops", lambda: tm.backward_flops(1, 3, 3, 1, 2**63), "d_h", 2**63),
    ]:
        with pytest.raises(tm.ArgumentError) as e:
            call()
        assert e.value.code == "overflow"
        assert str(e.value) == f"{fn}: {name} must fit in a signed 64-bit integer; got {value}"
    with pytest.raises(TypeError) as e:
        tm.forward_flops(1, 3.0, 3, 1, 1)
    assert str(e.value) == "forward_flops: T_q must be an integer; got float"
    with pytest.raises(TypeError, match=r"^visible_keys: t must be an integer; got str$"):
        tm.visible_keys("0", 3, 3)


@pytest.mark.parametrize("causal,align", [(True, "bottom_right"), (True, "top_left"),
                                          (False, "bottom_right")])
def test_backward_flops_is_two_and_a_half_times_forward(causal, align):
    for B, T_q, T_k, H_q, d_h in [(1, 8, 8, 2, 16), (3, 5, 17, 4, 7), (2, 17, 5, 1, 128)]:
        P = tm.visible_pairs(T_q, T_k, causal, align)
        fwd = tm.forward_flops(B, T_q, T_k, H_q, d_h, causal, align)
        assert fwd == 4 * d_h * H_q * P * B  # SPEC "Useful-work counts"
        assert tm.backward_flops(B, T_q, T_k, H_q, d_h, causal, align) == 2.5 * fwd


# --- TOKENMIX_CPU_CAP -----------------------------------------------------------------------------


def test_cpu_cap_follows_the_environment(monkeypatch):
    monkeypatch.delenv("TOKENMIX_CPU_CAP", raising=False)
    assert tm.cpu_cap() is None
    uncapped = tm.available_isas()
    monkeypatch.setenv("TOKENMIX_CPU_CAP", "")
    assert tm.cpu_cap() is None
    monkeypatch.setenv("TOKENMIX_CPU_CAP", "portable")
    assert tm.cpu_cap() == "portable"
    assert tm.available_isas() == ["portable"] and tm.resolve_isa() == "portable"
    assert not tm.cpu_features()["avx2_fma"] and not tm.cpu_features()["avx512f"]
    monkeypatch.setenv("TOKENMIX_CPU_CAP", "avx2")
    assert tm.cpu_cap() == "avx2" and "avx512" not in tm.available_isas()
    q = np.random.standard_normal((1, 4, 2, 8)).astype(np.float32)
    with pytest.raises(tm.UnsupportedError):
        tm.attention_forward(q, q, q, isa="avx512")
    monkeypatch.setenv("TOKENMIX_CPU_CAP", "sse2")
    with pytest.raises(tm.ArgumentError) as e:
        tm.cpu_cap()
    assert e.value.code == "invalid_argument" and "TOKENMIX_CPU_CAP" in str(e.value)
    monkeypatch.delenv("TOKENMIX_CPU_CAP")
    assert tm.available_isas() == uncapped


# --- TOKENMIX_LINEAR_PREFETCH, TOKENMIX_FP8_WIDEN: two-valued decode switches ----------------------


def check_decode_switch(monkeypatch, var, query, on, off, bad, dtypes, tnew):
    """query() follows `var` (on: True, off: False, empty and unset: the same automatic choice);
    decode over a cache of each of `dtypes` gives the same bits either way; `bad` is an
    ArgumentError naming `var`, from query() and from decode alike."""
    monkeypatch.setenv(var, on)
    assert query() is True
    monkeypatch.setenv(var, off)
    assert query() is False
    monkeypatch.setenv(var, "")
    automatic = query()
    monkeypatch.delenv(var)
    assert query() == automatic
    rng = np.random.default_rng(5)
    k = rng.standard_normal((1, 1100, 2, 64)).astype(np.float32)
    v = rng.standard_normal((1, 1100, 2, 64)).astype(np.float32)
    q = rng.standard_normal((1, tnew, 8, 64)).astype(np.float32)
    for dtype in dtypes:
        cache = tm.KVCache(layers=1, batch=1, heads_kv=2, head_dim=64, capacity=1100, dtype=dtype)
        cache.append(0, k, v)
        outs = {}
        for value in (on, off):
            monkeypatch.setenv(var, value)
            outs[value] = tm.attention_decode(q, cache, 0)
        np.testing.assert_array_equal(outs[on], outs[off], err_msg=dtype)
    monkeypatch.setenv(var, bad)
    with pytest.raises(tm.ArgumentError) as e:
        query()
    assert e.value.code == "invalid_argument" and var in str(e.value)
    with pytest.raises(tm.ArgumentError):
        tm.attention_decode(q, cache, 0)


def test_linear_prefetch_follows_the_environment_and_gives_the_same_results(monkeypatch):
    """TOKENMIX_LINEAR_PREFETCH: every cache dtype prefetched in address order, or each path's
    per-dtype choice; only the prefetches differ, for every cache dtype (T_new = 3: tall units)."""
    check_decode_switch(monkeypatch, "TOKENMIX_LINEAR_PREFETCH", tm.linear_decode_prefetch, "all",
                        "per-dtype", "rows", ("f32", "bf16", "f16", "int8", "fp8_e4m3"), 3)


@pytest.mark.parametrize("dtype,feature,tnew", [("int8", "amx_int8", 1), ("fp8_e4m3", "amx_bf16", 4),
                                                ("bf16", "amx_bf16", 8)])
def test_decode_amx_follows_the_environment(monkeypatch, dtype, feature, tnew):
    """TOKENMIX_DECODE_AMX: an fp8 cache's units of >= 16 rows (T_new 4 x 4 query heads per KV
    head; an int8 cache's from 4 rows, T_new 1; a bf16 cache's from 32 rows, T_new 8) on AMX tiles
    or on FMAs: the same results
    at fp32 rounding level, not the same bits (the tile path ran). Where AMX cannot run, `on`
    raises UnsupportedError from the call; another value raises ArgumentError, and so does another
    cache dtype."""
    var = "TOKENMIX_DECODE_AMX"
    monkeypatch.setenv(var, "off")
    assert tm.decode_amx(dtype) is False
    monkeypatch.delenv(var, raising=False)
    usable = tm.decode_amx(dtype)
    assert usable == (tm.decode_amx(dtype) and tm.cpu_features()[feature])
    with pytest.raises(tm.ArgumentError) as e:
        tm.decode_amx("f16")
    assert "cache_dtype must be int8, fp8_e4m3 or bf16" in str(e.value)
    rng = np.random.default_rng(9)
    k = rng.standard_normal((1, 1100, 2, 128)).astype(np.float32)
    v = rng.standard_normal((1, 1100, 2, 128)).astype(np.float32)
    q = rng.standard_normal((1, tnew, 8, 128)).astype(np.float32)
    cache = tm.KVCache(layers=1, batch=1, heads_kv=2, head_dim=128, capacity=1100, dtype=dtype)
    cache.append(0, k, v)
    monkeypatch.setenv(var, "off")
    off = tm.attention_decode(q, cache, 0)
    monkeypatch.setenv(var, "on")
    if usable:
        on = tm.attention_decode(q, cache, 0)
        np.testing.assert_allclose(on, off, rtol=0, atol=2e-5 * float(np.abs(off).max()))
        assert not np.array_equal(on, off)
    else:
        with pytest.raises(tm.UnsupportedError) as e:
            tm.attention_decode(q, cache, 0)
        assert var in str(e.value)
    monkeypatch.setenv(var, "sometimes")
    with pytest.raises(tm.ArgumentError) as e:
        tm.decode_amx(dtype)
    assert e.value.code == "invalid_argument" and var in str(e.value)
    with pytest.raises(tm.ArgumentError):
        tm.attention_decode(q, cache, 0)


def test_fp8_widening_follows_the_environment_and_gives_the_same_results(monkeypatch):
    """TOKENMIX_FP8_WIDEN: an fp8 cache read straight as fp32 bits or through f16 bits; the same
    bits either way (the readings differ only where a product is subnormal)."""
    check_decode_switch(monkeypatch, "TOKENMIX_FP8_WIDEN", tm.fp8_direct_widening, "direct", "f16",
                        "fp16", ("fp8_e4m3",), 1)
