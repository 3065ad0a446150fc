"""Type stubs of the native extension tokenmix._tokenmix (python/src: module.cpp and one file per
area — attention.cpp, ops.cpp, kv_cache.cpp, layer.cpp, runtime.cpp, errors.cpp, convert.cpp,
bench_ceilings.cpp).

Use the ``tokenmix`` package: its functions allocate outputs, handle layouts and call these.
Arrays are native-endian float32 NumPy arrays or CPU torch tensors ("Array"), passed without
copying, any non-negative strides that are whole elements; the attention tensors (q, k, v, out,
dout, dq, dk, dv of attention_forward/backward, their varlen forms and attention_decode) may
also be bfloat16 (ml_dtypes.bfloat16, torch.bfloat16) or float16, one dtype per call (else
TypeError); lse stays float32. Attention tensors are logical
[B, T, H, d_h]; log-sum-exp [B, H, T]. Errors name the function and the argument: another dtype
(also '>f4') or device → TypeError; a byte stride not a multiple of 4, ``threads`` outside
[0, 2**31 − 1] or a library error → ArgumentError (``code``); kernel scratch that cannot be
allocated → ResourceError (a MemoryError); a read-only output → ValueError. ``align`` is
"bottom_right" or "top_left" (tokenmix::parse_causal_align; else ArgumentError).
"""

from typing import Any, List, Optional, Sequence

Array = Any  # numpy.ndarray[float32] | torch.Tensor (CPU, float32)

class ArgumentError(ValueError):
    """Invalid arguments; ``code`` is the tokenmix ErrorCode name ("shape_mismatch", ...)."""
    code: str

class UnsupportedError(NotImplementedError):
    """A valid request this build or CPU cannot serve (e.g. a forced ISA)."""
    code: str

class FileError(OSError):
    code: str

class ResourceError(MemoryError):
    """Memory a call needs could not be allocated ("out_of_memory") or its size overflows
    ("overflow")."""
    code: str

def attention_forward(q: Array, k: Array, v: Array, out: Array, lse: Optional[Array],
                      scale: Optional[float], causal: bool, align: str, threads: int,
                      isa: str, window: Optional[int] = None, softcap: Optional[float] = None,
                      alibi_slopes: Optional[Array] = None, sinks: Optional[Array] = None,
                      mask: Optional[Array] = None, key_lengths: Optional[Array] = None,
                      dropout_p: float = 0.0, dropout_seed: int = 0,
                      dropout_offset: int = 0) -> None:
    """q [B,T_q,H_q,d_h], k/v [B,T_k,H_kv,d_h] → out [B,T_q,H_q,d_h], lse [B,H_q,T_q]
    (SPEC 4.2–4.5). Variants (SPEC "Score variants used by real models"): alibi_slopes, sinks
    [H_q] float32; mask rank 4 [B,H_q,T_q,T_k] (each axis full or 1, any strides) bool or
    float32; key_lengths [B] int32/int64."""
def attention_backward(q: Array, k: Array, v: Array, out: Array, lse: Array, dout: Array,
                       dq: Array, dk: Array, dv: Array, scale: Optional[float], causal: bool,
                       align: str, threads: int, isa: str, window: Optional[int] = None,
                       softcap: Optional[float] = None, alibi_slopes: Optional[Array] = None,
                       sinks: Optional[Array] = None, mask: Optional[Array] = None,
                       key_lengths: Optional[Array] = None,
                       dsinks: Optional[Array] = None, dropout_p: float = 0.0,
                       dropout_seed: int = 0, dropout_offset: int = 0) -> None:
    """Writes dq [B,T_q,H_q,d_h], dk/dv [B,T_k,H_kv,d_h] (SPEC "Backward pass") and, with
    sinks, dsinks [H_q]."""
def attention_weights(q: Array, k: Array, lse: Array, weights: Array,
                      heads: Optional[List[int]], row_begin: int, row_end: Optional[int],
                      scale: Optional[float], causal: bool, align: str, threads: int, isa: str,
                      window: Optional[int] = None, softcap: Optional[float] = None,
                      alibi_slopes: Optional[Array] = None, sinks: Optional[Array] = None,
                      mask: Optional[Array] = None, key_lengths: Optional[Array] = None,
                      dropout_p: float = 0.0, dropout_seed: int = 0,
                      dropout_offset: int = 0) -> None:
    """weights [B,heads,rows,T_k] float32 ← P = exp(S + M − L) (SPEC 4.2–4.4) of q
    [B,T_q,H_q,d_h], k [B,T_k,H_kv,d_h] and the forward's lse [B,H_q,T_q]; heads None = all,
    rows [row_begin, row_end) (None = T_q)."""
def attention_forward_varlen(q: Array, k: Array, v: Array, cu_seqlens_q: Array,
                             cu_seqlens_k: Array, out: Array, lse: Optional[Array],
                             scale: Optional[float], causal: bool, align: str, threads: int,
                             isa: str, window: Optional[int] = None,
                             softcap: Optional[float] = None,
                             alibi_slopes: Optional[Array] = None,
                             sinks: Optional[Array] = None, dropout_p: float = 0.0,
                             dropout_seed: int = 0, dropout_offset: int = 0) -> None:
    """q [total_q,H_q,d_h], k/v [total_k,H_kv,d_h], cu_seqlens [n+1] int32/int64 → out
    [total_q,H_q,d_h], lse [H_q,total_q]."""
def attention_backward_varlen(q: Array, k: Array, v: Array, out: Array, lse: Array, dout: Array,
                              cu_seqlens_q: Array, cu_seqlens_k: Array, dq: Array, dk: Array,
                              dv: Array, scale: Optional[float], causal: bool, align: str,
                              threads: int, isa: str, window: Optional[int] = None,
                              softcap: Optional[float] = None,
                              alibi_slopes: Optional[Array] = None,
                              sinks: Optional[Array] = None,
                              dsinks: Optional[Array] = None, dropout_p: float = 0.0,
                              dropout_seed: int = 0, dropout_offset: int = 0) -> None: ...
def attention_dropout_mask(keep: Array, dropout_p: float, dropout_seed: int, dropout_offset: int,
                           threads: int = 0) -> None:
    """keep [B,H_q,T_q,T_k] bool ← the dropout keep mask Z (docs/design.md D.2–D.3)."""
def merge_partials(o1: Array, lse1: Array, o2: Array, lse2: Array, out: Array,
                   lse_out: Array) -> None:
    """o [B,T,H,d_h], lse [B,H,T]: L = log(e^L1 + e^L2), O = e^(L1−L) O1 + e^(L2−L) O2."""
def visible_keys(t: int, T_q: int, T_k: int, causal: bool, align: str) -> int: ...
def visible_pairs(T_q: int, T_k: int, causal: bool, align: str) -> int: ...
def forward_flops(B: int, T_q: int, T_k: int, H_q: int, d_h: int, causal: bool,
                  align: str) -> float: ...
def backward_flops(B: int, T_q: int, T_k: int, H_q: int, d_h: int, causal: bool,
                   align: str) -> float:
    """2.5 × forward_flops (SPEC "Useful-work counts")."""
def visible_keys_windowed(t: int, T_q: int, T_k: int, causal: bool, align: str,
                          window: int) -> int:
    """pairs(t) with a sliding window W ≥ 1 (SPEC "Score variants": window)."""
def visible_pairs_windowed(T_q: int, T_k: int, causal: bool, align: str, window: int) -> int: ...
def forward_flops_windowed(B: int, T_q: int, T_k: int, H_q: int, d_h: int, causal: bool,
                           align: str, window: int) -> float: ...
def backward_flops_windowed(B: int, T_q: int, T_k: int, H_q: int, d_h: int, causal: bool,
                            align: str, window: int) -> float: ...
def rope_forward(x: Array, pairing: str, base: float, position_offset: int) -> None:
    """Rotates x [B,T,H,d_h] in place (SPEC 4.1, RoPE)."""
def rope_backward(dx: Array, pairing: str, base: float, position_offset: int) -> None:
    """Inverse rotation of dx [B,T,H,d_h] in place."""
def logsumexp(z: Array) -> float:
    """z [n], C-contiguous."""
def softmax_rows(z: Array, a: Array) -> None:
    """z, a [rows, n], C-contiguous (SPEC 4.4)."""
def softmax_jacobian(a: Array, jacobian: Array) -> None:
    """a [n] → J [n, n] = diag(a) − a aᵀ (4.6)."""
def softmax_jacobian_vector_product(a: Array, g: Array, out: Array) -> None:
    """a, g, out [n]: J g = a ⊙ (g − ⟨a, g⟩) (4.7)."""
def version() -> str: ...
def default_threads() -> int: ...
def available_isas() -> list[str]: ...
def resolve_isa(isa: str) -> str: ...
def describe_kernel(isa: str) -> str: ...
def cpu_cap() -> Optional[str]:
    """The TOKENMIX_CPU_CAP cap in effect ("portable", "avx2", "avx512"), None when unset."""
def fp8_direct_widening() -> bool:
    """True if the avx512 and avx2 decode kernels read an fp8 E4M3 cache straight as fp32 bits,
    False if through f16 bits (TOKENMIX_FP8_WIDEN=direct|f16, read at each call; automatic: direct
    on AMD families 19h and 1Ah: Zen 3, Zen 4, Zen 5). Same results either way."""
def linear_decode_prefetch() -> bool:
    """True if the avx512 and avx2 decode kernels prefetch every cache dtype's next tile pair in
    address order, False if each path's per-dtype choice (TOKENMIX_LINEAR_PREFETCH=all|per-dtype,
    read at each call; automatic: all on Intel). Same results either way."""
def decode_amx(cache_dtype: str = "int8") -> bool:
    """True if decode over a `cache_dtype` cache ("int8", "fp8_e4m3" or "bf16") on the avx512 paths
    runs the products of its larger units (int8 from 4 rows, fp8 from 16, bf16 from 32) on AMX tiles: AMX-INT8 for
    int8, AMX-BF16 for fp8 and bf16 (a bf16 tile holding NaN, inf, subnormal or huge values takes
    an exact fallback) (TOKENMIX_DECODE_AMX=on|off, read at each call; automatic: where the CPU
    has them,
    cpu_features()["amx_int8"] / ["amx_bf16"], and Linux grants the tile data). Results agree with
    the FMA products at fp32 rounding level, not bitwise. Raises UnsupportedError for `on` where
    they cannot run, ArgumentError for another cache dtype."""
def cpu_features() -> dict[str, Any]:
    """{"model": str, "avx2_fma": bool, "avx512f": bool, "avx512_bf16": bool, "amx_tile": bool,
    "amx_int8": bool, "amx_bf16": bool, "neon": bool, "flags": list[str]}"""
def kv_cache_bytes(n_layers: int, batch: int, tokens: int, heads_kv: int, head_dim: int,
                   element_bytes: int) -> int:
    """2 · n · B · T · H_kv · d_h · sizeof(element) (SPEC 4.8)."""

class KVCache:
    """Keys/values of n layers × B sequences, [n, B, T, H_kv, d_h] each, in "f32", "bf16",
    "f16", or quantized "int8" / "fp8_e4m3" (one byte per element; fp32 scales per V row and,
    for K, per channel of each closed 64-position tile, the tile being filled held in float32
    until it closes: SPEC "Quantized KV cache"; rows holding NaN or ±inf are refused) (SPEC 4.8). block_tokens = 0: contiguous; else paged with blocks of that many
    positions (a multiple of 64) from a pool of pool_blocks (0 = enough for all at capacity).
    window = W ≥ 1: a rolling buffer for a sliding-window layer (only the last
    retained_positions ≥ W positions are kept; storage O(W)). int8_quads (int8 only): the
    tiles in VNNI-4 quads (True, what AMX-INT8 multiplies: ask for it on such a CPU) or plain rows
    (False, the default on every CPU). Every path reads both, with the same bits. Every mutating method validates
    first: on error the cache is unchanged."""
    def __init__(self, layers: int, batch: int, heads_kv: int, head_dim: int, capacity: int,
                 dtype: str = "f32", block_tokens: int = 0, pool_blocks: int = 0,
                 window: int = 0, int8_quads: bool | None = None) -> None: ...
    layers: int
    batch: int
    heads_kv: int
    head_dim: int
    capacity: int
    dtype: str
    paged: bool
    int8_quads: bool
    window: int
    retained_positions: int
    block_tokens: int
    pool_blocks: int
    free_blocks: int
    storage_bytes: int
    memory_bytes: int
    def length(self, seq: int, layer: int = 0) -> int: ...
    def first_position(self, seq: int, layer: int = 0) -> int:
        """The oldest position still held (0 unless the cache is rolling)."""
    def active(self, seq: int) -> bool: ...
    def append(self, layer: int, k: Array, v: Array, first_seq: int = 0) -> None:
        """k, v [B', T_new, H_kv, d_h] float32 (post-RoPE) for sequences
        first_seq … first_seq+B'−1."""
    def truncate(self, seq: int, new_length: int) -> None: ...
    def copy_sequences(self, source: KVCache, sources: Sequence[int]) -> None:
        """Sequence b becomes a copy of source's sequence sources[b], for every b < batch
        (source may be self: beam-search reordering)."""
    def release(self, seq: int) -> None: ...
    def reset(self, seq: Optional[int] = None) -> None: ...
    def decode_bytes(self, layer: int, first_seq: int, batch: int, window: int = 0,
                     tnew: int = 1) -> int: ...

def attention_decode(q: Array, cache: KVCache, layer: int, out: Array, lse: Optional[Array],
                     scale: Optional[float], threads: int, isa: str, first_seq: int,
                     window: Optional[int] = None, softcap: Optional[float] = None,
                     alibi_slopes: Optional[Array] = None,
                     sinks: Optional[Array] = None) -> None:
    """q/out [B',T_new,H_q,d_h], lse [B',H_q,T_new]; "bottom_right" causal against the cache,
    with the score variants window, softcap, alibi_slopes [H_q] and sinks [H_q]."""

class CausalSelfAttention:
    def __init__(self, d_model: int, heads_q: int, heads_kv: int, head_dim: int,
                 rope: Optional[str], rope_base: float, scale: Optional[float], threads: int,
                 isa: str, window: Optional[int] = None, softcap: Optional[float] = None,
                 alibi_slopes: Optional[Array] = None,
                 sinks: Optional[Array] = None) -> None: ...
    d_model: int
    heads_q: int
    heads_kv: int
    head_dim: int
    scale: Optional[float]
    window: Optional[int]
    softcap: Optional[float]
    rope: Optional[str]
    rope_base: float
    w_q: Any  # numpy view [d, H_q·d_h]
    w_k: Any  # [d, H_kv·d_h]
    w_v: Any  # [d, H_kv·d_h]
    w_o: Any  # [H_q·d_h, d]
    def init_random(self, seed: int) -> None: ...
    def forward(self, u: Array, out: Array) -> None:
        """u, out [B, T, d] C-contiguous."""
    def backward(self, d_out: Array) -> tuple[Any, Any, Any, Any, Any, Any]:
        """→ (d_u [B,T,d], d_w_q, d_w_k, d_w_v, d_w_o, d_sinks [H_q] or None) as NumPy
        arrays."""
    def prefill(self, u: Array, cache: KVCache, layer: int, out: Array, first_seq: int) -> None: ...
    def step(self, u: Array, cache: KVCache, layer: int, out: Array, first_seq: int) -> None: ...
    def saved(self) -> dict[str, Any]: ...

# --- the benchmark ceilings (bench_ceilings.cpp: tools/bench/ceilings.hpp, the C++ bench's own;
# tokenmix.bench wraps them). threads 0 = all (default_threads()).

class BenchSgemmCeiling:
    """The fp32 GEMM ceiling: C = A B through OpenBLAS (the system's, as `tokenmix bench`),
    n = 2048, seeded N(0, 1) operands (48 MiB, allocated here)."""
    def __init__(self) -> None: ...
    def pass_gflops(self, threads: int, calls: int) -> float:
        """Best GFLOP/s of ``calls`` calls on ``threads`` OpenBLAS threads, no warm-up: one pass
        interleaved with timed calls (calls < 1 → ArgumentError)."""
    def best_gflops(self, threads: int, repeats: int = 10) -> float:
        """A warm-up call, then the best of ``repeats``."""

class BenchStreamRead:
    """Streaming read bandwidth over a buffer of ``bytes`` (rounded down to 16 KiB blocks; under
    one block → ArgumentError), backed by huge pages like the KV cache."""
    def __init__(self, bytes: int) -> None: ...
    def pass_gbps(self, threads: int) -> float:
        """One timed read of the buffer by ``threads`` threads (the widest vectors), GB/s."""
    bytes: int
    kind: str
    """"stream_read_1GiB", "stream_read_8MiB", ... (the CLI's ceiling_gbps_kind)."""

def bench_sgemm_core() -> str:
    """OpenBLAS's sgemm kernel family ("Haswell", "SkylakeX", ...)."""
def bench_sgemm_ceiling_warning() -> str:
    """Empty, or why the sgemm ceiling is below this CPU's (no AVX-512 in OpenBLAS's kernel)."""
def bench_cpu_has_bf16_gemm() -> bool:
    """AVX512-BF16 or AMX-BF16, under TOKENMIX_CPU_CAP."""
def bench_have_onednn() -> bool:
    """Whether the extension was built with oneDNN (the bf16 GEMM ceiling)."""
def bench_gemm_ceiling_choice(dtype: str) -> tuple[bool, str]:
    """(bf16 GEMM?, ceiling_kind) of forward/backward for activations of ``dtype``."""
def bench_bf16_gemm_ceiling(threads: int, repeats: int = 10) -> tuple[float, str]:
    """(GFLOP/s, kind) of oneDNN's bf16 matmul 2048³, best of ``repeats`` after a warm-up;
    UnsupportedError without oneDNN or without a bf16 matmul for this CPU."""
def bench_ceiling_spread(passes: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of a ceiling's passes; ArgumentError when empty."""
def bench_after_sgemm_pause_s() -> float:
    """Seconds to wait after an sgemm pass before timing anything (D-bench-5)."""
