// fuzz/fuzz_api.cpp — libFuzzer target for the argument validation of every public entry point.
//
// The input is decoded into one call (or, for the KV cache, a short sequence of calls): which
// entry point, the logical shapes, strides, dtypes, ranks and data pointers of its views, span
// sizes and the options (scale, causal, align, threads, isa, RoPE base and offset, cache sizes).
// The contract under test (include/tokenmix/error.hpp): a call either succeeds or throws a
// tokenmix::Error; any other exception, a crash, a hang or a sanitizer report is a finding.
//
// Memory is real: a view the fuzzer hands to the library points into a buffer covering every
// element the view addresses (a view claiming more than its buffer is a caller bug no library
// can detect). Views too large to back with memory are passed only where the call must fail
// anyway (negative sizes or strides, sizes overflowing 64-bit arithmetic, wrong rank or dtype);
// valid but large requests are skipped. Where the decoded arguments are invalid for a reason the
// fuzzer can tell, it also checks that the call did throw.
// KV cache sequences use all five cache dtypes (f32, bf16, f16, int8, fp8_e4m3); an append may
// get a NaN / ±∞ element, which a quantized cache must refuse (SPEC "Quantized KV cache"), and a
// failing append must leave the cache's lengths and (small caches) storage unchanged.
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tokenmix/tokenmix.hpp"

namespace {

using namespace tokenmix;
using i64 = std::int64_t;

constexpr i64 kMaxElements = i64{1} << 15;  // largest buffer backing one view (floats)

/// Reads the fuzz input front to back; once exhausted every read returns zeros.
class Input {
 public:
  Input(const std::uint8_t* data, std::size_t size) : p_(data), n_(size) {}
  std::uint8_t byte() { return i_ < n_ ? p_[i_++] : 0; }
  bool flag() { return (byte() & 1) != 0; }
  /// Mostly small sizes (0–8), sometimes medium, sometimes extreme or negative.
  i64 size() {
    const std::uint8_t b = byte();
    if (b < 200) return b % 9;
    if (b < 236) return 9 + byte() % 80;
    static const i64 special[] = {-1,
                                  -64,
                                  std::numeric_limits<i64>::min(),
                                  std::numeric_limits<i64>::max(),
                                  std::numeric_limits<i64>::max() - 63,
                                  i64{1} << 31,
                                  (i64{1} << 31) - 1,
                                  i64{1} << 32,
                                  i64{1} << 40,
                                  i64{1} << 62,
                                  (i64{1} << 62) + 1,
                                  i64{3} << 61,
                                  std::numeric_limits<std::int32_t>::max(),
                                  64,
                                  128,
                                  4096,
                                  65536,
                                  1000003,
                                  std::numeric_limits<i64>::max() / 4 + 1,
                                  std::numeric_limits<i64>::max() / 2};
    return special[b % (sizeof(special) / sizeof(special[0]))];
  }
  double real() {
    const std::uint8_t b = byte();
    static const double special[] = {std::numeric_limits<double>::quiet_NaN(),
                                     std::numeric_limits<double>::infinity(),
                                     -std::numeric_limits<double>::infinity(),
                                     0.0,
                                     -0.0,
                                     1e308,
                                     -1e308,
                                     1e39,
                                     4e-324,
                                     1e-45,
                                     0.125,
                                     1.0,
                                     -1.0,
                                     10000.0,
                                     500000.0,
                                     3.4e38};
    if (b < 16) return special[b];
    return (static_cast<double>(b) - 136.0) / 16.0;
  }
  int threads() {
    static const int t[] = {0, 1, 2, 3, 1, 0, -1, std::numeric_limits<int>::min()};
    return t[byte() % 8];
  }
  // 0–5 are the enumerators (4 neon, 5 avx512_bf16: CPU-dependent, may fail or run); 6 is not
  Isa isa() { return static_cast<Isa>(byte() % 7); }

 private:
  const std::uint8_t* p_;
  std::size_t n_;
  std::size_t i_ = 0;
};

/// 128-bit arithmetic for the fuzzer's own bookkeeping (never overflows for int64 inputs).
using i128 = __int128;
constexpr i128 kI64Max = std::numeric_limits<i64>::max();

/// Backing memory of the views of one call. deque: growing it never moves a buffer.
struct Arenas {
  std::deque<std::vector<float>> buffers;
  std::vector<float> dummy = std::vector<float>(16, 0.0f);
  float* allocate(i64 n, Input& in) {
    std::vector<float>& b = buffers.emplace_back(static_cast<std::size_t>(n));
    const std::uint32_t seed = in.byte();
    for (std::size_t i = 0; i < b.size(); ++i)
      b[i] = static_cast<float>(((i * 2654435761u + seed * 40503u) >> 7) % 2001) / 500.0f - 2.0f;
    if (!b.empty() && in.byte() < 24) b[in.byte() % b.size()] = static_cast<float>(in.real());
    return b.data();
  }
};

/// A decoded view: must_fail says the call that receives it has to throw; too_big that it could
/// not be backed by memory (the call is skipped unless it must fail).
struct Decoded {
  TensorView view;
  bool must_fail = false;
  bool too_big = false;
};

/// Decodes one view of logical rank `rank` whose intended shape is `want`.
Decoded decode_view(Input& in, Arenas& arenas, int rank, std::array<i64, 4> want) {
  Decoded d;
  TensorView& v = d.view;
  v.rank = rank;
  v.dtype = DType::f32;
  const std::uint8_t mode = in.byte();
  if (mode >= 250) {  // an unusual rank or dtype
    if (in.flag())
      v.rank = in.byte() % 6;  // 5 is beyond the shape array
    else
      // a dtype no attention view takes (bool, i32, i64, or not an enumerator): bf16/f16 are
      // valid when every activation view has them, which this per-view decoding cannot predict
      v.dtype = static_cast<DType>(3 + in.byte() % 4);
  }
  for (int i = 0; i < 4; ++i) v.shape[i] = (i < rank && in.byte() < 232) ? want[i] : in.size();
  if (v.rank != rank || v.dtype != DType::f32) d.must_fail = true;
  // Strides: contiguous, [B,H,T,D]-like, padded, or decoded one by one.
  const int layout = mode % 4;
  const int r = rank;
  i128 s = 1;
  for (int i = r - 1; i >= 0; --i) {
    v.strides[i] = static_cast<i64>(std::min<i128>(s, kI64Max));
    i128 dim = v.shape[i] < 0 ? 1 : v.shape[i];
    if (layout == 2) dim += in.byte() % 3;
    s = std::min<i128>(s * std::max<i128>(dim, 1), kI64Max);
  }
  if (layout == 1 && r == 4) std::swap(v.strides[1], v.strides[2]);
  if (layout == 3)
    for (int i = 0; i < r; ++i) v.strides[i] = in.size();
  for (int i = r; i < 4; ++i) v.strides[i] = in.flag() ? 0 : in.size();

  // Element count and largest offset over the dimensions the library reads (v.rank of them).
  const int used = std::min(std::max(v.rank, 0), 4);
  bool empty = false, negative = false;
  i128 count = 1, extent = 0;
  for (int i = 0; i < used; ++i) {
    if (v.shape[i] < 0 || v.strides[i] < 0) negative = true;
    if (v.shape[i] == 0) empty = true;
  }
  if (negative) d.must_fail = true;
  if (!negative && !empty) {
    for (int i = 0; i < used; ++i) {
      count = std::min<i128>(count * v.shape[i], kI64Max + 1);
      // Each term < 2^126: clamp so that four of them cannot overflow 128 bits.
      extent += std::min<i128>(static_cast<i128>(v.shape[i] - 1) * v.strides[i], i128{1} << 100);
    }
    if (count > kI64Max || (extent + 1) * 4 > kI64Max) d.must_fail = true;
  }
  const std::uint8_t ptr = in.byte();
  if (empty || negative || v.rank > 4) {
    v.data = ptr < 16 ? nullptr : arenas.dummy.data();
  } else if (extent + 1 > kMaxElements || count > 64 * kMaxElements) {
    // Too much memory to back, or (zero strides) too many elements to compute on quickly.
    v.data = arenas.dummy.data();
    if (!d.must_fail) d.too_big = true;
  } else if (ptr < 8) {
    v.data = nullptr;  // a null pointer for a non-empty view: must fail
    d.must_fail = true;
  } else if (ptr < 40 && !arenas.buffers.empty()) {
    // Share memory with an earlier view (aliasing checks), when it fits in that buffer.
    std::vector<float>& b = arenas.buffers[in.byte() % arenas.buffers.size()];
    const i64 need = static_cast<i64>(extent) + 1;
    if (need <= static_cast<i64>(b.size())) {
      const i64 off = in.byte() % (static_cast<i64>(b.size()) - need + 1);
      v.data = b.data() + off;
    } else {
      v.data = arenas.allocate(need, in);
    }
  } else {
    v.data = arenas.allocate(static_cast<i64>(extent) + 1, in);
  }
  return d;
}

/// Runs `call` and enforces the contract: success or tokenmix::Error only; and an Error when
/// the fuzzer knows the arguments are invalid.
template <class F>
void expect_contract(bool must_fail, F&& call) {
  try {
    call();
  } catch (const Error&) {
    return;
  } catch (const std::exception& e) {  // any other exception escaping an entry point: a finding
    std::fprintf(stderr, "fuzz_api: a non-tokenmix exception escaped: %s\n", e.what());
    std::abort();
  } catch (...) {
    std::fprintf(stderr, "fuzz_api: a non-std exception escaped\n");
    std::abort();
  }
  if (must_fail) {
    std::fprintf(stderr, "fuzz_api: invalid arguments were accepted (no tokenmix::Error)\n");
    std::abort();
  }
}

/// a·k saturated to the int64 range (the fuzzer's own arithmetic must not overflow).
i64 times(i64 a, i64 k) {
  i64 r = 0;
  if (__builtin_mul_overflow(a, k, &r))
    return a < 0 ? std::numeric_limits<i64>::min() : std::numeric_limits<i64>::max();
  return r;
}

struct Dims {
  i64 b, tq, tk, hq, hkv, dh;
};

Dims decode_dims(Input& in) {
  Dims d;
  d.b = in.size();
  d.tq = in.size();
  d.tk = in.flag() ? d.tq : in.size();
  d.hkv = in.size();
  d.hq = in.flag() ? times(d.hkv, 1 + in.byte() % 4) : in.size();
  d.dh = in.size();
  return d;
}

AttentionOptions decode_attention_options(Input& in, bool& must_fail) {
  AttentionOptions o;
  if (in.flag()) {
    o.scale = in.real();
    if (!std::isfinite(*o.scale)) must_fail = true;
  }
  o.causal = !in.flag();
  o.align = in.flag() ? CausalAlign::top_left : CausalAlign::bottom_right;
  o.threads = in.threads();
  if (o.threads < 0) must_fail = true;
  o.isa = in.isa();
  if (static_cast<int>(o.isa) > 5) must_fail = true;  // not an enumerator
  return o;
}

// One decoded group of views; `fail` collects must_fail, `skip` too_big.
struct Views {
  std::vector<Decoded> v;
  bool fail = false, skip = false;
  TensorView add(Input& in, Arenas& a, int rank, std::array<i64, 4> want, bool optional = false) {
    if (optional && in.byte() < 64) return {};  // an empty (absent) view
    Decoded d = decode_view(in, a, rank, want);
    if (optional && d.view.data == nullptr) return {};  // null data means "not wanted"
    fail = fail || d.must_fail;
    skip = skip || d.too_big;
    v.push_back(d);
    return d.view;
  }
};

// True when a call of `pairs` query-key pairs (B·T_q·T_k·H_q) of width d_h costs more than
// 2^22 pair·(d_h + 4) units: under the sanitizers and coverage instrumentation the portable path
// takes about 0.6 µs per pair and feature plus a few per pair, so valid ones are skipped (2^25
// pairs at d_h = 2 once took 89 s; a layer forward + backward of 2^19.6 pairs at d_h = 24 took
// 12–23 s: both timed out the fuzzing stage).
bool long_running(long double pairs, long double dh) {
  return pairs * (dh + 4) > (1 << 22);
}
// The same for a call on q [B, T_q, H_q, d_h] and k [B, T_k, H_kv, d_h].
bool long_running(const TensorView& q, const TensorView& k) {
  if (q.rank != 4 || k.rank != 4) return false;
  long double pairs = 1;
  for (const i64 x : {q.shape[0], q.shape[1], k.shape[1], q.shape[2]}) {
    if (x <= 0) return false;
    pairs *= static_cast<long double>(x);
  }
  return long_running(pairs, static_cast<long double>(q.shape[3]));
}

void fuzz_attention_forward(Input& in) {
  Arenas a;
  Views vs;
  const Dims d = decode_dims(in);
  auto q = vs.add(in, a, 4, {d.b, d.tq, d.hq, d.dh});
  auto k = vs.add(in, a, 4, {d.b, d.tk, d.hkv, d.dh});
  auto v = vs.add(in, a, 4, {d.b, d.tk, d.hkv, d.dh});
  auto out = vs.add(in, a, 4, {d.b, d.tq, d.hq, d.dh});
  auto lse = vs.add(in, a, 3, {d.b, d.hq, d.tq, 1}, true);
  bool fail = vs.fail;
  const AttentionOptions o = decode_attention_options(in, fail);
  if ((vs.skip || long_running(q, k)) && !fail) return;
  expect_contract(fail, [&] { attention_forward(q, k, v, out, lse, o); });
}

void fuzz_attention_backward(Input& in) {
  Arenas a;
  Views vs;
  const Dims d = decode_dims(in);
  auto q = vs.add(in, a, 4, {d.b, d.tq, d.hq, d.dh});
  auto k = vs.add(in, a, 4, {d.b, d.tk, d.hkv, d.dh});
  auto v = vs.add(in, a, 4, {d.b, d.tk, d.hkv, d.dh});
  auto out = vs.add(in, a, 4, {d.b, d.tq, d.hq, d.dh});
  auto lse = vs.add(in, a, 3, {d.b, d.hq, d.tq, 1});
  auto dout = vs.add(in, a, 4, {d.b, d.tq, d.hq, d.dh});
  auto dq = vs.add(in, a, 4, {d.b, d.tq, d.hq, d.dh});
  auto dk = vs.add(in, a, 4, {d.b, d.tk, d.hkv, d.dh});
  auto dv = vs.add(in, a, 4, {d.b, d.tk, d.hkv, d.dh});
  bool fail = vs.fail;
  const AttentionOptions o = decode_attention_options(in, fail);
  if ((vs.skip || long_running(q, k)) && !fail) return;
  expect_contract(fail, [&] { attention_backward(q, k, v, out, lse, dout, dq, dk, dv, o); });
}

void fuzz_merge(Input& in) {
  Arenas a;
  Views vs;
  const Dims d = decode_dims(in);
  auto o1 = vs.add(in, a, 4, {d.b, d.tq, d.hq, d.dh});
  auto l1 = vs.add(in, a, 3, {d.b, d.hq, d.tq, 1});
  auto o2 = vs.add(in, a, 4, {d.b, d.tq, d.hq, d.dh});
  auto l2 = vs.add(in, a, 3, {d.b, d.hq, d.tq, 1});
  TensorView out, lout;
  if (in.byte() < 64) {  // in-place accumulation into part 1 (documented as allowed)
    out = TensorView{const_cast<void*>(static_cast<const void*>(o1.data)), o1.dtype, o1.rank,
                     o1.shape, o1.strides};
    lout = TensorView{const_cast<void*>(static_cast<const void*>(l1.data)), l1.dtype, l1.rank,
                      l1.shape, l1.strides};
  } else {
    out = vs.add(in, a, 4, {d.b, d.tq, d.hq, d.dh});
    lout = vs.add(in, a, 3, {d.b, d.hq, d.tq, 1});
  }
  if (vs.skip && !vs.fail) return;
  expect_contract(vs.fail, [&] { merge_partials(o1, l1, o2, l2, out, lout); });
}

void fuzz_rope(Input& in) {
  Arenas a;
  Views vs;
  const Dims d = decode_dims(in);
  auto x = vs.add(in, a, 4, {d.b, d.tq, d.hq, d.dh});
  RopeOptions o;
  o.pairing = in.flag() ? RopePairing::interleaved : RopePairing::rotate_half;
  bool fail = vs.fail;
  if (in.flag()) {
    o.base = in.real();
    if (!std::isfinite(o.base) || !(o.base > 0)) fail = true;
  }
  o.position_offset = in.flag() ? in.size() : 0;
  if (o.position_offset < 0) fail = true;
  if (x.rank == 4 && x.shape[3] % 2 != 0 && x.shape[3] > 0) fail = true;
  if (vs.skip && !fail) return;
  const bool backward = in.flag();
  expect_contract(fail, [&] { backward ? rope_backward(x, o) : rope_forward(x, o); });
}

void fuzz_softmax(Input& in) {
  // Spans are always backed by exactly the memory they claim; rows and n are free.
  const std::uint8_t op = in.byte() % 4;
  const std::size_t nz = static_cast<std::size_t>(in.byte()) * (in.flag() ? 1 : 3);
  std::vector<float> z(nz), a(static_cast<std::size_t>(in.byte()) * (in.flag() ? 1 : 3));
  for (std::size_t i = 0; i < z.size(); ++i) z[i] = static_cast<float>(in.real());
  for (std::size_t i = 0; i < a.size(); ++i) a[i] = static_cast<float>(in.byte()) / 255.0f;
  const i64 rows = in.size(), n = in.size();
  expect_contract(false, [&] {
    switch (op) {
      case 0:
        (void)logsumexp(z);
        break;
      case 1:
        softmax_rows(z, in.flag() ? std::span<float>(z) : std::span<float>(a), rows, n);
        break;
      case 2:
        softmax_jacobian(a, z);
        break;
      default:
        softmax_jacobian_vector_product(a, z,
                                        in.flag() ? std::span<float>(z) : std::span<float>(a));
        break;
    }
  });
}

/// Rough bytes a KV cache with this configuration allocates (for skipping large valid ones).
long double cache_bytes_estimate(const KVCacheConfig& c) {
  const long double tile = 64;
  long double bt = c.block_tokens > 0 ? c.block_tokens : std::ceil(c.capacity / tile) * tile;
  long double pool = c.block_tokens > 0 ? (c.pool_blocks > 0 ? c.pool_blocks
                                                             : c.batch * std::ceil(c.capacity / bt))
                                        : c.batch;
  const long double storage = 2.0L * c.layers * pool * bt * c.heads_kv * c.head_dim * 4;
  const long double table = static_cast<long double>(c.batch) * std::ceil(c.capacity / bt) * 4;
  return storage + table + 8.0L * c.layers * c.batch + c.batch;
}

/// True if an element of the valid rank-4 fp32 view v (its own shape and strides) is NaN or ±∞.
bool has_non_finite(const TensorView& v) {
  if (v.data == nullptr || v.rank != 4 || v.dtype != DType::f32) return false;
  for (int i = 0; i < 4; ++i)
    if (v.shape[i] < 1) return false;  // empty (an outer extent may still be huge)
  const float* p = static_cast<const float*>(v.data);
  for (i64 i = 0; i < v.shape[0]; ++i)
    for (i64 j = 0; j < v.shape[1]; ++j)
      for (i64 h = 0; h < v.shape[2]; ++h)
        for (i64 x = 0; x < v.shape[3]; ++x) {
          const float e =
              p[i * v.strides[0] + j * v.strides[1] + h * v.strides[2] + x * v.strides[3]];
          if (!std::isfinite(e)) return true;
        }
  return false;
}

/// Sets one element of the valid non-empty rank-4 fp32 view v (chosen by the input) to x.
void set_element(const TensorView& v, Input& in, float x) {
  if (v.data == nullptr || v.rank != 4 || v.dtype != DType::f32) return;
  // An empty view (a zero dimension) may have any strides: no offset is computed for it (the
  // products of a later-empty view's indices and strides may overflow).
  for (int i = 0; i < 4; ++i)
    if (v.shape[i] < 1) return;
  i64 off = 0;
  for (int i = 0; i < 4; ++i) off += (in.byte() % v.shape[i]) * v.strides[i];
  static_cast<float*>(v.data)[off] = x;
}

/// Every (sequence, layer) length of the cache.
std::vector<i64> lengths(const KVCache& cache) {
  std::vector<i64> n;
  for (i64 b = 0; b < cache.config().batch; ++b)
    for (i64 l = 0; l < cache.config().layers; ++l) n.push_back(cache.length(b, l));
  return n;
}

void fuzz_kv_cache(Input& in) {
  KVCacheConfig c;
  c.layers = in.size();
  c.batch = in.size();
  c.heads_kv = in.size();
  c.head_dim = in.size();
  c.capacity = in.size();
  // 0–2 and 6–7 are the cache dtypes (f32, bf16, f16, int8, fp8_e4m3); 3–5 element types no
  // cache takes (bool, i32, i64); 8 not an enumerator.
  c.dtype = static_cast<DType>(in.byte() % 9);
  c.block_tokens = in.flag() ? 64 * (in.byte() % 3) : in.size();
  c.pool_blocks = c.block_tokens != 0 && in.flag() ? in.size() : 0;
  const bool quantized = c.dtype == DType::int8 || c.dtype == DType::fp8_e4m3;
  const bool invalid = c.layers < 1 || c.batch < 1 || c.heads_kv < 1 || c.head_dim < 1 ||
                       c.capacity < 1 || (static_cast<int>(c.dtype) > 2 && !quantized) ||
                       c.block_tokens < 0 || c.block_tokens % 64 != 0 || c.pool_blocks < 0 ||
                       (c.block_tokens == 0 && c.pool_blocks != 0);
  const long double bytes = invalid ? 0 : cache_bytes_estimate(c);
  if (!invalid && bytes > (1 << 23)) {
    if (bytes < 0x1p70L) return;  // valid and large: would really allocate it
    // Sizes whose products overflow 64-bit arithmetic: must be rejected before allocating.
    expect_contract(true, [&] { KVCache cache(c); });
    return;
  }
  std::optional<KVCache> cache;
  expect_contract(invalid, [&] { cache.emplace(c); });
  if (!cache) return;

  // A short sequence of operations on the cache.
  for (int step = 0; step < 6; ++step) {
    const std::uint8_t op = in.byte() % 8;
    Arenas a;
    Views vs;
    switch (op) {
      case 0:
      case 1: {  // append
        const i64 layer = in.flag() ? in.byte() % (c.layers + 1) : in.size();
        const i64 first = in.flag() ? in.byte() % (c.batch + 1) : in.size();
        const i64 b = in.flag() ? in.byte() % 3 : in.size();
        const i64 t = in.size();
        auto k = vs.add(in, a, 4, {b, t, c.heads_kv, c.head_dim});
        auto v = vs.add(in, a, 4, {b, t, c.heads_kv, c.head_dim});
        if (vs.skip && !vs.fail) break;
        const std::uint8_t poison = in.byte();  // < 96: a NaN / ±∞ element in k or v
        if (poison < 96 && !vs.fail) {
          static const float bad[] = {std::numeric_limits<float>::quiet_NaN(),
                                      std::numeric_limits<float>::infinity(),
                                      -std::numeric_limits<float>::infinity()};
          set_element(poison % 2 != 0 ? v : k, in, bad[poison % 3]);
        }
        // Quantized caches refuse rows holding NaN or ±∞ (no finite scale represents them);
        // a failing append leaves the cache as it was (checked on small caches).
        const bool non_finite = !vs.fail && (has_non_finite(k) || has_non_finite(v));
        const bool snap = cache->storage_bytes() <= (1u << 20);
        std::vector<std::byte> before;
        if (snap) before.assign(cache->raw_storage().begin(), cache->raw_storage().end());
        const std::vector<i64> lengths_before = lengths(*cache);
        bool threw = true;
        expect_contract(vs.fail || (quantized && non_finite), [&] {
          cache->append(layer, first, k, v);
          threw = false;
        });
        if (threw &&
            (lengths(*cache) != lengths_before ||
             (snap && !std::equal(before.begin(), before.end(), cache->raw_storage().begin(),
                                  cache->raw_storage().end())))) {
          std::fprintf(stderr, "fuzz_api: a failing KVCache::append changed the cache\n");
          std::abort();
        }
        break;
      }
      case 2:
      case 3: {  // decode
        const i64 layer = in.flag() ? in.byte() % (c.layers + 1) : in.size();
        DecodeOptions o;
        o.first_seq = in.flag() ? in.byte() % (c.batch + 1) : in.size();
        const i64 b = in.flag() ? in.byte() % 3 : in.size();
        const i64 t = in.size();
        const i64 hq = in.flag() ? times(c.heads_kv, 1 + in.byte() % 3) : in.size();
        auto q = vs.add(in, a, 4, {b, t, hq, c.head_dim});
        auto out = vs.add(in, a, 4, {b, t, hq, c.head_dim});
        auto lse = vs.add(in, a, 3, {b, hq, t, 1}, true);
        bool fail = vs.fail;
        if (in.flag()) {
          o.scale = in.real();
          if (!std::isfinite(*o.scale)) fail = true;
        }
        o.threads = in.threads();
        o.isa = in.isa();
        if (o.threads < 0 || static_cast<int>(o.isa) > 5) fail = true;
        if (vs.skip && !fail) break;
        expect_contract(fail, [&] { attention_decode(q, *cache, layer, out, lse, o); });
        break;
      }
      case 4: {
        const i64 seq = in.size(), len = in.size();
        expect_contract(false, [&] { cache->truncate(seq, len); });
        break;
      }
      case 5: {
        const i64 seq = in.size();
        expect_contract(false, [&] { in.flag() ? cache->release(seq) : cache->reset(seq); });
        break;
      }
      case 6: {
        const i64 layer = in.size(), first = in.size(), b = in.size();
        expect_contract(false, [&] {
          (void)decode_bytes(*cache, layer, first, b);
          (void)cache->length(first, layer);
          (void)cache->active(first);
        });
        break;
      }
      default:
        cache->reset();
        break;
    }
  }
}

void fuzz_layer(Input& in) {
  LayerConfig c;
  c.d_model = in.size();
  c.heads_kv = in.size();
  c.heads_q = in.flag() ? times(c.heads_kv, 1 + in.byte() % 3) : in.size();
  c.head_dim = in.size();
  if (in.flag()) {
    RopeOptions r;
    r.pairing = in.flag() ? RopePairing::interleaved : RopePairing::rotate_half;
    r.base = in.flag() ? in.real() : 10000.0;
    r.position_offset = in.flag() ? in.size() : 0;
    c.rope = r;
  }
  bool options_invalid = false;  // the layer may reject them when built or when run
  c.attention = decode_attention_options(in, options_invalid);
  (void)options_invalid;
  const bool invalid = c.d_model < 1 || c.heads_q < 1 || c.heads_kv < 1 || c.head_dim < 1;
  if (!invalid) {
    const long double w =
        static_cast<long double>(c.d_model) * c.head_dim * (2.0L * c.heads_q + 2.0L * c.heads_kv);
    if (w > (1 << 20)) {
      if (w < 0x1p70L) return;
      expect_contract(true, [&] { CausalSelfAttention layer(c); });
      return;
    }
  }
  std::optional<CausalSelfAttention> layer;
  expect_contract(invalid, [&] { layer.emplace(c); });
  if (!layer) return;
  if (in.flag()) layer->init_random(in.byte());

  // forward / backward / prefill / step with span sizes from the input (always backed).
  const i64 batch = in.size(), seq = in.size();
  auto span_len = [&](i64 want) -> std::size_t {
    if (in.byte() < 200 && want >= 0 && want <= kMaxElements) return static_cast<std::size_t>(want);
    return in.byte() % 64;
  };
  const long double rows = static_cast<long double>(batch) * seq * c.d_model;
  const i64 want = rows >= 0 && rows <= kMaxElements ? static_cast<i64>(rows) : -1;
  // The layer allocates Q, K, V, Y for batch·seq tokens: skip valid calls that would be large.
  const long double saved =
      static_cast<long double>(batch) * seq * c.head_dim * (2.0L * c.heads_q + 2.0L * c.heads_kv);
  if (want >= 0 && saved > (1 << 22)) return;
  // ... and valid calls whose attention alone is long: B·T²·H_q query-key pairs of d_h each
  // (see long_running; such inputs timed out).
  const long double pairs = static_cast<long double>(batch) * seq * seq * c.heads_q;
  if (want >= 0 && long_running(pairs, static_cast<long double>(c.head_dim))) return;
  std::vector<float> u(span_len(want), 0.25f), out(span_len(want), 0.0f);
  const std::uint8_t op = in.byte() % 3;
  if (op == 0) {
    expect_contract(false, [&] { layer->forward(u, batch, seq, out); });
    LayerGradients g;
    std::vector<float> d_out(span_len(static_cast<i64>(out.size())), 1.0f);
    expect_contract(false, [&] { layer->backward(d_out, g); });
  } else {
    KVCacheConfig kc;
    kc.layers = 1 + in.byte() % 2;
    kc.batch = 1 + in.byte() % 3;
    kc.heads_kv = in.flag() ? c.heads_kv : 1 + in.byte() % 4;
    kc.head_dim = in.flag() ? c.head_dim : 1 + in.byte() % 16;
    kc.capacity = 1 + in.byte() % 130;
    static const DType cache_dtypes[] = {DType::f32, DType::bf16, DType::f16, DType::int8,
                                         DType::fp8_e4m3};
    kc.dtype = cache_dtypes[in.byte() % 5];
    if (cache_bytes_estimate(kc) > (1 << 23)) return;
    KVCache cache(kc);
    const i64 layer_index = in.byte() % 3, first = in.byte() % 4;
    for (int i = 0; i < 3; ++i) {
      if (op == 1)
        expect_contract(false,
                        [&] { layer->prefill(u, batch, seq, cache, layer_index, out, first); });
      else
        expect_contract(false, [&] { layer->step(u, batch, cache, layer_index, out, first); });
    }
  }
}

void fuzz_misc(Input& in) {
  // Counting helpers (they throw ArgumentError for t outside [0, T_q), negative sizes, a bad
  // align or a count beyond int64), names and parsers.
  const i64 tq = in.byte() % 200, tk = in.size() & ((i64{1} << 40) - 1);
  const bool causal = in.flag();
  const std::uint8_t align_byte = in.byte();
  const CausalAlign align = static_cast<CausalAlign>(align_byte % 3);  // 2: not an enumerator
  const bool bad_align = align_byte % 3 == 2;
  const i64 row = in.byte() % 200, batch = in.size() & 0xffff, hq = in.byte(), dw = in.byte();
  expect_contract(bad_align || row >= tq, [&] { (void)visible_keys(row, tq, tk, causal, align); });
  expect_contract(bad_align, [&] { (void)visible_pairs(tq, tk, causal, align); });
  expect_contract(bad_align, [&] { (void)forward_flops(batch, tq, tk, hq, dw, causal, align); });
  expect_contract(bad_align, [&] { (void)backward_flops(batch, tq, tk, hq, dw, causal, align); });
  (void)to_string(align);
  (void)to_string(static_cast<Isa>(in.byte() % 8));
  (void)to_string(static_cast<DType>(in.byte() % 8));
  (void)to_string(static_cast<ErrorCode>(in.byte() % 12));
  (void)size_of(static_cast<DType>(in.byte() % 8));
  std::string text;
  for (std::uint8_t n = in.byte() % 12; n > 0; --n) text.push_back(static_cast<char>(in.byte()));
  expect_contract(false, [&] { (void)parse_isa(text, "fuzz"); });
  expect_contract(false, [&] { (void)parse_causal_align(text, "fuzz"); });
  const i64 l = in.size(), b = in.size(), t = in.size(), h = in.size(), dh = in.size();
  const std::size_t e = in.byte() % 9;
  expect_contract(false, [&] { (void)kv_cache_bytes(l, b, t, h, dh, e); });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Input in(data, size);
  switch (in.byte() % 8) {
    case 0:
      fuzz_attention_forward(in);
      break;
    case 1:
      fuzz_attention_backward(in);
      break;
    case 2:
      fuzz_merge(in);
      break;
    case 3:
      fuzz_rope(in);
      break;
    case 4:
      fuzz_softmax(in);
      break;
    case 5:
      fuzz_kv_cache(in);
      break;
    case 6:
      fuzz_layer(in);
      break;
    default:
      fuzz_misc(in);
      break;
  }
  return 0;
}
