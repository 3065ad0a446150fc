// src/model/layer.cpp — the causal self-attention layer (SPEC 4.1–4.5) and KV-cache sizing (4.8).
#include "tokenmix/layer.hpp"

#include <cblas.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <initializer_list>
#include <string>
#include <vector>

#include "decode/decode_internal.hpp"
#include "decode/kv_cache_access.hpp"
#include "kernels/kernel_skeleton.hpp"
#include "kernels/scratch_arena.hpp"
#include "kernels/small_gemm.hpp"
#include "tokenmix/kv_cache.hpp"
#include "util/validate.hpp"

namespace tokenmix {
namespace {

using detail::checked_mul;
using detail::fail;

// C[M,N] = op(A) op(B) (+ C if accumulate), row-major, through OpenBLAS sgemm. BLAS takes int
// sizes, so each is checked (a larger layer is an overflow error, not a silent wrap).
void gemm(bool trans_a, bool trans_b, std::int64_t M, std::int64_t N, std::int64_t K,
          const float* A, const float* B, float* C, bool accumulate) {
  for (std::int64_t x : {M, N, K}) {
    if (x > INT_MAX)
      fail(ErrorCode::overflow, "CausalSelfAttention",
           "matrix size " + std::to_string(x) + " exceeds BLAS int range");
  }
  const int lda = static_cast<int>(trans_a ? M : K), ldb = static_cast<int>(trans_b ? K : N);
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, static_cast<int>(M), static_cast<int>(N),
              static_cast<int>(K), 1.0f, A, lda, B, ldb, accumulate ? 1.0f : 0.0f, C,
              static_cast<int>(N));
}

// Projections of a few rows (a decode step: one token per sequence). OpenBLAS sgemm packs the
// whole weight matrix for M = 1 (reading and writing it again), and its sgemv splits the
// reduction of the transposed product differently with the thread count (seen with 0.3.21:
// the results change bitwise between 1, 2, 3 and 4 threads), so these rows take small_gemm.
constexpr std::int64_t kSmallRows = 8;
// Reduction rows per partial product: fixed, so the order of every sum is the same for any
// thread count (a team shares out the chunks, never splits one).
constexpr std::int64_t kChunkK = 128;
// Columns per unit of the final sum of the partial products.
constexpr std::int64_t kReduceCols = 1024;

// Products of one small_gemm call (Q, K, V).
constexpr std::size_t kMaxProducts = 3;

// One product of small_gemm: C [M, n] = A [M, K] · B [K, n], row-major.
struct Product {
  const float* b;
  std::int64_t n;
  float* c;
};

// The partial products of small_gemm: per thread, reused (only grows).
std::vector<float>& gemm_scratch() {
  thread_local std::vector<float> scratch;
  return scratch;
}

// Elements of the partial products small_gemm keeps for M rows and reduction length K: every
// chunk's M rows of each product, ld_total = the products' row strides summed.
std::size_t partial_elems(std::int64_t M, std::int64_t K, std::int64_t ld_total) {
  return static_cast<std::size_t>((K + kChunkK - 1) / kChunkK * M * ld_total);
}

// The same for products of the widths ns (each partial's rows kernels::small_gemm_row_stride
// apart): what a call of small_gemm on them needs.
std::size_t small_gemm_scratch(std::int64_t M, std::int64_t K,
                               std::initializer_list<std::int64_t> ns) {
  std::int64_t ld_total = 0;
  for (std::int64_t n : ns) ld_total += kernels::small_gemm_row_stride(n);
  return partial_elems(M, K, ld_total);
}

// C_p = A B_p for every product p, M <= kSmallRows rows of A shared (a decode step's Q, K and V
// in one call). Every weight byte is read once, in contiguous chunks of kChunkK rows: unit
// (p, c) writes P_{p,c} = A[:, rows of c] B_p[rows of c, :] (a running sum over the rows of the
// chunk, in order), then C_p = P_{p,0} + P_{p,1} + … in chunk order. Neither order depends on
// `threads` or on how the team shares the units, so the result does not either.
void small_gemm(std::int64_t M, std::int64_t K, const float* A, std::span<const Product> ps,
                int threads, Isa isa) {
  // The chunk of the call's path (kernels/small_gemm.hpp): the same bits on every path.
  const kernels::SmallGemmChunk chunk = kernels::small_gemm_chunk(isa);
  const std::int64_t chunks = (K + kChunkK - 1) / kChunkK;
  // Per product: where its partials start, its first unit of the final sum (nothing here
  // allocates but a growing scratch: after prefill reserved it, this cannot fail).
  // Each partial P_{p,c} is [M][ldp[p]] (kernels::small_gemm_row_stride: rows not 4 KiB apart).
  std::array<std::int64_t, kMaxProducts + 1> offset{}, reduce_first{};
  std::array<std::int64_t, kMaxProducts> ldp{};
  std::int64_t n_total = 0, ld_total = 0, reduce_units = 0;
  for (std::size_t i = 0; i < ps.size(); ++i) {
    ldp[i] = kernels::small_gemm_row_stride(ps[i].n);
    offset[i] = chunks * M * ld_total;
    reduce_first[i] = reduce_units;
    n_total += ps[i].n;
    ld_total += ldp[i];
    reduce_units += M * ((ps[i].n + kReduceCols - 1) / kReduceCols);
  }
  reduce_first[ps.size()] = reduce_units;
  std::vector<float>& scratch = gemm_scratch();
  const std::size_t need = partial_elems(M, K, ld_total);
  if (scratch.size() < need) scratch.resize(need);
  kernels::poison_scratch(scratch.data(), static_cast<std::int64_t>(need * sizeof(float)));
  float* const part = scratch.data();
  const std::int64_t units = static_cast<std::int64_t>(ps.size()) * chunks;
  const int team = kernels::team_size(
      kernels::threads_for_work(
          threads, static_cast<double>(M) * static_cast<double>(K) * static_cast<double>(n_total)),
      units);

#pragma omp parallel num_threads(team)
  {
#pragma omp for schedule(dynamic, 1)
    for (std::int64_t unit = 0; unit < units; ++unit) {
      const std::size_t pi = static_cast<std::size_t>(unit / chunks);
      const std::int64_t c = unit % chunks, n = ps[pi].n;
      const std::int64_t k0 = c * kChunkK, k1 = std::min(K, k0 + kChunkK);
      chunk(M, K, A, ps[pi].b, n, k0, k1, part + offset[pi] + c * M * ldp[pi],
            ldp[pi]);  // P_{p,c} [M, n], rows ldp apart
    }
#pragma omp for schedule(static)
    for (std::int64_t unit = 0; unit < reduce_units; ++unit) {
      std::size_t pi = 0;
      while (unit >= reduce_first[pi + 1]) ++pi;
      const std::int64_t n = ps[pi].n, blocks = (n + kReduceCols - 1) / kReduceCols;
      const std::int64_t m = (unit - reduce_first[pi]) / blocks;
      const std::int64_t j0 = (unit - reduce_first[pi]) % blocks * kReduceCols;
      const std::int64_t j1 = std::min(n, j0 + kReduceCols);
      float* __restrict cm = ps[pi].c + m * n;
      const float* p0 = part + offset[pi] + m * ldp[pi];
      for (std::int64_t j = j0; j < j1; ++j) cm[j] = p0[j];
      for (std::int64_t c = 1; c < chunks; ++c) {
        const float* __restrict pc = p0 + c * M * ldp[pi];
        for (std::int64_t j = j0; j < j1; ++j) cm[j] = cm[j] + pc[j];
      }
    }
  }
}

// Deterministic, platform-independent uniform numbers (splitmix64).
std::uint64_t splitmix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Uniform in [−a, a] with a = sqrt(3 / fan_in): variance 1/fan_in keeps activations O(1).
void fill_uniform(std::vector<float>& w, std::uint64_t seed, std::int64_t fan_in) {
  const double a = std::sqrt(3.0 / static_cast<double>(fan_in));
  for (std::size_t i = 0; i < w.size(); ++i) {
    const double unit =
        static_cast<double>(splitmix64(seed ^ (i * 0x2545f4914f6cdd1dull)) >> 11) * 0x1.0p-53;
    w[i] = static_cast<float>((2.0 * unit - 1.0) * a);
  }
}

void check_span(const char* fn, const char* name, std::size_t got, std::int64_t expected,
                const char* what) {
  if (static_cast<std::int64_t>(got) != expected) {
    fail(ErrorCode::shape_mismatch, fn,
         std::string(name) + ".size() must equal " + what + " = " + std::to_string(expected) +
             "; got " + std::to_string(got));
  }
}

// Validates the [batch, seq, d] input and output of forward/prefill; returns batch · seq.
std::int64_t check_layer_io(const char* fn, std::span<const float> u, std::span<float> out,
                            std::int64_t batch, std::int64_t seq, std::int64_t d_model) {
  if (batch < 1)
    fail(ErrorCode::invalid_argument, fn, "batch must be >= 1; got " + std::to_string(batch));
  if (seq < 1)
    fail(ErrorCode::invalid_argument, fn, "seq must be >= 1; got " + std::to_string(seq));
  const std::int64_t rows = checked_mul(batch, seq, fn, "batch * seq");
  const std::int64_t n_u = checked_mul(rows, d_model, fn, "batch * seq * d_model");
  check_span(fn, "u", u.size(), n_u, "batch * seq * d_model");
  check_span(fn, "out", out.size(), n_u, "batch * seq * d_model");
  if (u.data() == nullptr || out.data() == nullptr)
    fail(ErrorCode::null_pointer, fn, "u and out must not be null");
  if (out.data() < u.data() + u.size() && u.data() < out.data() + out.size()) {
    fail(ErrorCode::aliasing, fn, "out overlaps u; the layer cannot run in place");
  }
  return rows;
}

// Validates a rank-1 [H_q] f32 option of the layer's attention (ALiBi slopes, sinks; any stride)
// and returns a contiguous copy; empty view → empty vector. Values are data, as for
// attention_forward (NaN and ±∞ propagate).
std::vector<float> copy_head_vector(const char* fn, const char* name, const ConstTensorView& v,
                                    std::int64_t hq) {
  if (v.empty()) return {};
  detail::check_view(v, 1, fn, name);
  detail::check_dim(v, 0, hq, fn, name, "H_q", "config.heads_q");
  std::vector<float> out(static_cast<std::size_t>(hq));
  for (std::int64_t h = 0; h < hq; ++h)
    out[static_cast<std::size_t>(h)] = static_cast<const float*>(v.data)[h * v.strides[0]];
  return out;
}

// The decode options of the layer's attention (SPEC "Score variants"; decode is bottom-right).
DecodeOptions decode_options(const AttentionOptions& a, std::int64_t first_seq) {
  DecodeOptions o;
  o.scale = a.scale;
  o.threads = a.threads;
  o.isa = a.isa;
  o.first_seq = first_seq;
  o.window = a.window;
  o.softcap = a.softcap;
  o.alibi_slopes = a.alibi_slopes;
  o.sinks = a.sinks;
  return o;
}

}  // namespace

CausalSelfAttention::CausalSelfAttention(const LayerConfig& config) : config_(config) {
  constexpr const char* fn = "CausalSelfAttention";
  const std::pair<const char*, std::int64_t> sizes[] = {{"config.d_model", config.d_model},
                                                        {"config.heads_q", config.heads_q},
                                                        {"config.heads_kv", config.heads_kv},
                                                        {"config.head_dim", config.head_dim}};
  for (auto [name, x] : sizes) {
    if (x < 1)
      fail(ErrorCode::invalid_argument, fn,
           std::string(name) + " must be >= 1; got " + std::to_string(x));
  }
  if (config.heads_kv > config.heads_q || config.heads_q % config.heads_kv != 0) {
    fail(ErrorCode::shape_mismatch, fn,
         "config.heads_kv must divide config.heads_q (SPEC 4.8); got H_q = " +
             std::to_string(config.heads_q) + ", H_kv = " + std::to_string(config.heads_kv));
  }
  if (config.rope) {
    if (config.head_dim % 2 != 0) {
      fail(ErrorCode::invalid_argument, fn,
           "config.head_dim must be even when RoPE is on; got " + std::to_string(config.head_dim));
    }
    if (!std::isfinite(config.rope->base) || config.rope->base <= 0.0) {
      fail(ErrorCode::invalid_argument, fn,
           "config.rope.base must be finite and > 0; got " + std::to_string(config.rope->base));
    }
  }
  const AttentionOptions& a = config.attention;
  if (a.scale && (!std::isfinite(*a.scale) || !std::isfinite(static_cast<float>(*a.scale)))) {
    fail(ErrorCode::invalid_argument, fn,
         "config.attention.scale must be finite in float32; got " + std::to_string(*a.scale));
  }
  if (a.dropout.p != 0.0) {  // the layer serves inference: prefill and decode (no backward)
    fail(ErrorCode::unsupported, fn,
         "config.attention.dropout.p must be 0 (the layer runs inference: prefill and KV-cache "
         "decode, which have no dropout); got " +
             std::to_string(a.dropout.p) + "; use attention_forward/attention_backward to train");
  }
  if (a.threads < 0) {
    fail(ErrorCode::invalid_argument, fn,
         "config.attention.threads must be >= 0 (0 = all); got " + std::to_string(a.threads));
  }
  detail::check_align(fn, "config.attention.align", a.align);
  if (!a.causal || a.align != CausalAlign::bottom_right) {  // rejected, not silently overridden
    fail(ErrorCode::invalid_argument, fn,
         std::string("the layer is always causal with the bottom_right mask (SPEC 4.3); got "
                     "config.attention.causal = ") +
             (a.causal ? "true" : "false") + ", config.attention.align = " + to_string(a.align));
  }
  if (a.isa != Isa::automatic && a.isa != Isa::portable && a.isa != Isa::avx2 &&
      a.isa != Isa::avx512 && a.isa != Isa::neon && a.isa != Isa::avx512_bf16) {
    fail(ErrorCode::invalid_argument, fn,
         "config.attention.isa must be an Isa value (auto, portable, avx2, avx512, avx512_bf16, "
         "neon); got the value " +
             std::to_string(static_cast<int>(a.isa)));
  }
  // A forced path must run here (UnsupportedError otherwise); `automatic` follows TOKENMIX_ISA,
  // which is read again by every call.
  if (a.isa != Isa::automatic) resolve_isa(a.isa);
  // Score variants (SPEC "Score variants used by real models").
  if (a.window && *a.window < 1) {
    fail(ErrorCode::invalid_argument, fn,
         "config.attention.window must be >= 1; got " + std::to_string(*a.window));
  }
  if (a.softcap &&
      !(std::isfinite(*a.softcap) && *a.softcap > 0.0 &&
        std::isfinite(static_cast<float>(*a.softcap)) && static_cast<float>(*a.softcap) > 0.0f)) {
    fail(ErrorCode::invalid_argument, fn,
         "config.attention.softcap must be finite and > 0 in float32; got " +
             std::to_string(*a.softcap));
  }
  if (!a.mask.empty() || !a.key_lengths.empty()) {
    fail(ErrorCode::invalid_argument, fn,
         std::string("config.attention.mask and config.attention.key_lengths must be empty (a "
                     "layer has no per-call mask or key padding); got ") +
             (a.mask.empty() ? "key_lengths" : "a mask"));
  }
  alibi_ = copy_head_vector(fn, "config.attention.alibi_slopes", a.alibi_slopes, config.heads_q);
  sinks_ = copy_head_vector(fn, "config.attention.sinks", a.sinks, config.heads_q);
  bind_variant_views();
  const std::int64_t qw = checked_mul(config.heads_q, config.head_dim, fn, "H_q * d_h");
  const std::int64_t kw = checked_mul(config.heads_kv, config.head_dim, fn, "H_kv * d_h");
  w_q_.assign(static_cast<std::size_t>(checked_mul(config.d_model, qw, fn, "W_Q size")), 0.0f);
  w_k_.assign(static_cast<std::size_t>(checked_mul(config.d_model, kw, fn, "W_K size")), 0.0f);
  w_v_.assign(w_k_.size(), 0.0f);
  w_o_.assign(w_q_.size(), 0.0f);
}

void CausalSelfAttention::bind_variant_views() noexcept {
  const auto view = [this](const std::vector<float>& x) {
    return x.empty()
               ? ConstTensorView{}
               : ConstTensorView{x.data(), DType::f32, 1, {config_.heads_q, 1, 1, 1}, {1, 0, 0, 0}};
  };
  config_.attention.alibi_slopes = view(alibi_);
  config_.attention.sinks = view(sinks_);
}

CausalSelfAttention::CausalSelfAttention(const CausalSelfAttention& other)
    : config_(other.config_),
      alibi_(other.alibi_),
      sinks_(other.sinks_),
      w_q_(other.w_q_),
      w_k_(other.w_k_),
      w_v_(other.w_v_),
      w_o_(other.w_o_),
      saved_(other.saved_) {
  bind_variant_views();
}

CausalSelfAttention::CausalSelfAttention(CausalSelfAttention&& other) noexcept
    : config_(std::move(other.config_)),
      alibi_(std::move(other.alibi_)),
      sinks_(std::move(other.sinks_)),
      w_q_(std::move(other.w_q_)),
      w_k_(std::move(other.w_k_)),
      w_v_(std::move(other.w_v_)),
      w_o_(std::move(other.w_o_)),
      saved_(std::move(other.saved_)) {
  bind_variant_views();
  other.bind_variant_views();
}

CausalSelfAttention& CausalSelfAttention::operator=(const CausalSelfAttention& other) {
  if (this != &other) {
    CausalSelfAttention copy(other);
    *this = std::move(copy);
  }
  return *this;
}

CausalSelfAttention& CausalSelfAttention::operator=(CausalSelfAttention&& other) noexcept {
  if (this != &other) {
    config_ = std::move(other.config_);
    alibi_ = std::move(other.alibi_);
    sinks_ = std::move(other.sinks_);
    w_q_ = std::move(other.w_q_);
    w_k_ = std::move(other.w_k_);
    w_v_ = std::move(other.w_v_);
    w_o_ = std::move(other.w_o_);
    saved_ = std::move(other.saved_);
    bind_variant_views();
    other.bind_variant_views();
  }
  return *this;
}

void CausalSelfAttention::init_random(std::uint64_t seed) {
  fill_uniform(w_q_, splitmix64(seed + 1), config_.d_model);
  fill_uniform(w_k_, splitmix64(seed + 2), config_.d_model);
  fill_uniform(w_v_, splitmix64(seed + 3), config_.d_model);
  fill_uniform(w_o_, splitmix64(seed + 4), config_.heads_q * config_.head_dim);
}

void CausalSelfAttention::forward(std::span<const float> u, std::int64_t batch, std::int64_t seq,
                                  std::span<float> out) {
  constexpr const char* fn = "CausalSelfAttention::forward";
  const LayerConfig& c = config_;
  const std::int64_t rows = check_layer_io(fn, u, out, batch, seq, c.d_model);
  const std::int64_t qw = c.heads_q * c.head_dim, kw = c.heads_kv * c.head_dim;
  Saved s;
  s.batch = batch;
  s.seq = seq;
  s.u.assign(u.begin(), u.end());
  s.q.resize(static_cast<std::size_t>(checked_mul(rows, qw, fn, "Q size")));
  s.k.resize(static_cast<std::size_t>(checked_mul(rows, kw, fn, "K size")));
  s.v.resize(s.k.size());
  s.y.resize(s.q.size());
  s.lse.resize(static_cast<std::size_t>(checked_mul(batch * c.heads_q, seq, fn, "LSE size")));

  gemm(false, false, rows, qw, c.d_model, u.data(), w_q_.data(), s.q.data(),
       false);  // Q = U W_Q (4.1)
  gemm(false, false, rows, kw, c.d_model, u.data(), w_k_.data(), s.k.data(), false);  // K = U W_K
  gemm(false, false, rows, kw, c.d_model, u.data(), w_v_.data(), s.v.data(), false);  // V = U W_V
  const auto q = TensorView::bthd(s.q.data(), batch, seq, c.heads_q, c.head_dim);
  const auto k = TensorView::bthd(s.k.data(), batch, seq, c.heads_kv, c.head_dim);
  const auto v = TensorView::bthd(s.v.data(), batch, seq, c.heads_kv, c.head_dim);
  if (c.rope) {  // rotate Q and K before any score is formed (4.1)
    RopeOptions r = *c.rope;
    r.position_offset = 0;
    rope_forward(q, r);
    rope_forward(k, r);
  }
  const auto y = TensorView::bthd(s.y.data(), batch, seq, c.heads_q, c.head_dim);
  attention_forward(q, k, v, y, TensorView::bht(s.lse.data(), batch, c.heads_q, seq),
                    c.attention);  // (4.2–4.5)
  gemm(false, false, rows, c.d_model, qw, s.y.data(), w_o_.data(), out.data(),
       false);  // O = [Y_1|…] W_O
  saved_ = std::move(s);
}

void CausalSelfAttention::backward(std::span<const float> d_out, LayerGradients& g) {
  constexpr const char* fn = "CausalSelfAttention::backward";
  const LayerConfig& c = config_;
  const Saved& s = saved_;
  if (s.batch == 0)
    fail(ErrorCode::invalid_argument, fn, "backward needs a preceding forward; none was run");
  const std::int64_t rows = s.batch * s.seq;
  const std::int64_t qw = c.heads_q * c.head_dim, kw = c.heads_kv * c.head_dim;
  check_span(fn, "d_out", d_out.size(), rows * c.d_model,
             "batch * seq * d_model of the last forward");
  if (d_out.data() == nullptr) fail(ErrorCode::null_pointer, fn, "d_out must not be null");

  g.d_w_o.resize(static_cast<std::size_t>(qw * c.d_model));
  gemm(true, false, qw, c.d_model, rows, s.y.data(), d_out.data(), g.d_w_o.data(),
       false);  // dW_O = Yᵀ dO
  std::vector<float> dy(static_cast<std::size_t>(rows * qw));
  gemm(false, true, rows, qw, c.d_model, d_out.data(), w_o_.data(), dy.data(),
       false);  // dY = dO W_Oᵀ

  std::vector<float> dq(s.q.size()), dk(s.k.size()), dv(s.v.size());
  const auto B = s.batch, T = s.seq;
  g.d_sinks.assign(sinks_.size(), 0.0f);  // dσ_h (SPEC "Score variants": sinks)
  attention_backward(
      ConstTensorView::bthd(s.q.data(), B, T, c.heads_q, c.head_dim),
      ConstTensorView::bthd(s.k.data(), B, T, c.heads_kv, c.head_dim),
      ConstTensorView::bthd(s.v.data(), B, T, c.heads_kv, c.head_dim),
      ConstTensorView::bthd(s.y.data(), B, T, c.heads_q, c.head_dim),
      ConstTensorView::bht(s.lse.data(), B, c.heads_q, T),
      ConstTensorView::bthd(dy.data(), B, T, c.heads_q, c.head_dim),
      TensorView::bthd(dq.data(), B, T, c.heads_q, c.head_dim),
      TensorView::bthd(dk.data(), B, T, c.heads_kv, c.head_dim),
      TensorView::bthd(dv.data(), B, T, c.heads_kv, c.head_dim), c.attention,
      sinks_.empty()
          ? TensorView{}
          : TensorView{g.d_sinks.data(), DType::f32, 1, {c.heads_q, 1, 1, 1}, {1, 0, 0, 0}});
  if (c.rope) {  // RoPE is orthogonal: rotate the gradients back (inverse rotation)
    RopeOptions r = *c.rope;
    r.position_offset = 0;
    rope_backward(TensorView::bthd(dq.data(), B, T, c.heads_q, c.head_dim), r);
    rope_backward(TensorView::bthd(dk.data(), B, T, c.heads_kv, c.head_dim), r);
  }
  g.d_w_q.resize(w_q_.size());
  g.d_w_k.resize(w_k_.size());
  g.d_w_v.resize(w_v_.size());
  gemm(true, false, c.d_model, qw, rows, s.u.data(), dq.data(), g.d_w_q.data(),
       false);  // dW_Q = Uᵀ dQ
  gemm(true, false, c.d_model, kw, rows, s.u.data(), dk.data(), g.d_w_k.data(),
       false);  // dW_K = Uᵀ dK
  gemm(true, false, c.d_model, kw, rows, s.u.data(), dv.data(), g.d_w_v.data(),
       false);               // dW_V = Uᵀ dV
  g.d_u.resize(s.u.size());  // dU = dQ W_Qᵀ + dK W_Kᵀ + dV W_Vᵀ
  gemm(false, true, rows, c.d_model, qw, dq.data(), w_q_.data(), g.d_u.data(), false);
  gemm(false, true, rows, c.d_model, kw, dk.data(), w_k_.data(), g.d_u.data(), true);
  gemm(false, true, rows, c.d_model, kw, dv.data(), w_v_.data(), g.d_u.data(), true);
}

void CausalSelfAttention::prefill(std::span<const float> u, std::int64_t batch, std::int64_t seq,
                                  KVCache& cache, std::int64_t layer, std::span<float> out,
                                  std::int64_t first_seq) {
  constexpr const char* fn = "CausalSelfAttention::prefill";
  const LayerConfig& c = config_;
  const KVCacheConfig& kc = cache.config();
  const std::int64_t rows = check_layer_io(fn, u, out, batch, seq, c.d_model);
  if (kc.heads_kv != c.heads_kv || kc.head_dim != c.head_dim) {
    fail(ErrorCode::shape_mismatch, fn,
         "cache (heads_kv = " + std::to_string(kc.heads_kv) +
             ", head_dim = " + std::to_string(kc.head_dim) + ") must match the layer (heads_kv = " +
             std::to_string(c.heads_kv) + ", head_dim = " + std::to_string(c.head_dim) + ")");
  }
  if (layer < 0 || layer >= kc.layers) {
    fail(ErrorCode::invalid_argument, fn,
         "layer must be in [0, cache layers = " + std::to_string(kc.layers) + "); got " +
             std::to_string(layer));
  }
  if (first_seq < 0 || first_seq > kc.batch || batch > kc.batch - first_seq) {
    fail(ErrorCode::invalid_argument, fn,
         "sequences [first_seq, first_seq + batch) must lie in [0, cache batch = " +
             std::to_string(kc.batch) + "); got first_seq = " + std::to_string(first_seq) +
             ", batch = " + std::to_string(batch));
  }
  // Everything that can fail is checked before the cache changes (a failed call leaves it byte
  // for byte as it was): the sequences, their room, and the kernel path (TOKENMIX_ISA may be
  // invalid or name a path this CPU lacks).
  bool fresh = true;  // every sequence empty in this layer
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(batch));
  for (std::int64_t b = 0; b < batch; ++b) {
    if (!cache.active(first_seq + b)) {
      fail(ErrorCode::invalid_argument, fn,
           "sequence " + std::to_string(first_seq + b) +
               " of the cache was released; reset it before reuse");
    }
    const std::int64_t len = cache.length(first_seq + b, layer);
    if (seq > kc.capacity - len) {
      fail(ErrorCode::invalid_argument, fn,
           "appending seq = " + std::to_string(seq) + " positions to sequence " +
               std::to_string(first_seq + b) + " (length " + std::to_string(len) +
               ") exceeds the cache capacity T_max = " + std::to_string(kc.capacity));
    }
    lengths[static_cast<std::size_t>(b)] = len;
    fresh = fresh && len == 0;
  }
  if (cache.window() > 0 && (!c.attention.window || *c.attention.window > cache.window())) {
    fail(ErrorCode::invalid_argument, fn,
         "a rolling cache (config.window = " + std::to_string(cache.window()) +
             ") keeps only the last " + std::to_string(cache.retained_positions()) +
             " positions: config.attention.window must be set and <= " +
             std::to_string(cache.window()) + "; got " +
             (c.attention.window ? std::to_string(*c.attention.window) : std::string("none")));
  }
  AttentionOptions ao = c.attention;
  ao.isa = resolve_isa(c.attention.isa);  // the one dispatch decision of this call
  // A rolling cache holds R positions: the queries of one decode call see keys back to
  // (first query) − W + 1, so at most R − W + 1 new tokens are appended and decoded at a time.
  const std::int64_t piece =
      cache.window() > 0 ? cache.retained_positions() - *c.attention.window + 1 : seq;

  const std::int64_t qw = c.heads_q * c.head_dim, kw = c.heads_kv * c.head_dim;
  std::vector<float> q(static_cast<std::size_t>(checked_mul(rows, qw, fn, "Q size")));
  std::vector<float> k(static_cast<std::size_t>(checked_mul(rows, kw, fn, "K size"))), v(k.size()),
      y(q.size());
  const int threads = c.attention.threads == 0 ? default_threads() : c.attention.threads;
  if (rows <= kSmallRows) {
    // Q, K, V = U [W_Q | W_K | W_V] (4.1) in one pass over the three weights, on the layer's
    // threads. The W_O product's partials are reserved too, before the cache changes.
    std::vector<float>& scratch = gemm_scratch();
    const std::size_t need = std::max(small_gemm_scratch(rows, c.d_model, {qw, kw, kw}),
                                      small_gemm_scratch(rows, qw, {c.d_model}));
    if (scratch.size() < need) scratch.resize(need);
    const Product qkv[] = {
        {w_q_.data(), qw, q.data()}, {w_k_.data(), kw, k.data()}, {w_v_.data(), kw, v.data()}};
    small_gemm(rows, c.d_model, u.data(), qkv, threads, ao.isa);
  } else {
    gemm(false, false, rows, qw, c.d_model, u.data(), w_q_.data(), q.data(),
         false);  // Q = U W_Q (4.1)
    gemm(false, false, rows, kw, c.d_model, u.data(), w_k_.data(), k.data(), false);  // K = U W_K
    gemm(false, false, rows, kw, c.d_model, u.data(), w_v_.data(), v.data(), false);  // V = U W_V
  }
  const auto qv = TensorView::bthd(q.data(), batch, seq, c.heads_q, c.head_dim);
  const auto kv = TensorView::bthd(k.data(), batch, seq, c.heads_kv, c.head_dim);
  const auto vv = TensorView::bthd(v.data(), batch, seq, c.heads_kv, c.head_dim);
  if (c.rope) {  // positions len … len + seq − 1 of sequence b (4.1): one batch slice at a time
    for (std::int64_t b = 0; b < batch; ++b) {
      RopeOptions r = *c.rope;
      r.position_offset = lengths[static_cast<std::size_t>(b)];
      TensorView qb = qv, kb = kv;
      qb.shape[0] = kb.shape[0] = 1;
      qb.data = q.data() + b * seq * qw;
      kb.data = k.data() + b * seq * kw;
      rope_forward(qb, r);
      rope_forward(kb, r);
    }
  }
  const auto yv = TensorView::bthd(y.data(), batch, seq, c.heads_q, c.head_dim);
  if (kernels::is_quantized(kc.dtype)) {
    // A quantized cache (SPEC "Quantized KV cache"): attention reads x̂ from the cache even for a
    // fresh prefill (append, then attention_decode over the cache: no fp32 shortcut), and rows of
    // K or V holding NaN or ±∞, which it cannot store, are refused before anything is appended.
    fresh = false;
    detail::KVCacheAccess::check_finite_rows(cache, fn, kv, vv);
  }
  if (fresh) {
    // Attention on the fresh fp32 K/V first (4.2–4.5), so nothing after the append can fail.
    attention_forward(qv, kv, vv, yv, {}, ao);
    cache.append(layer, first_seq, kv, vv);  // validates everything (capacity, pool) before writing
  } else {
    // Tokens [t0, t0 + n) of every sequence: views of q, k, v, y.
    const auto part = [](TensorView x, std::int64_t t0, std::int64_t n) {
      x.data = static_cast<float*>(x.data) + t0 * x.strides[1];
      x.shape[1] = n;
      return x;
    };
    const DecodeOptions o = decode_options(ao, first_seq);
    // Every decode below is validated and its scratch reserved (this thread's reusable buffer
    // only grows) for the cache as it will be after its piece's append, before anything is
    // appended: after the first append nothing can fail (issue 11: a ResourceError from the
    // decode scratch used to leave the append behind).
    for (std::int64_t t0 = 0; t0 < seq; t0 += piece) {
      const std::int64_t n = std::min(piece, seq - t0);
      detail::prepare_decode(fn, part(qv, t0, n), cache, layer, part(yv, t0, n), {}, o, t0 + n);
    }
    // The appends together: capacity, pool (a paged rolling cache takes its ring blocks as the
    // pieces go). Each append validates again before it writes.
    detail::KVCacheAccess::check_growth(cache, fn, layer, first_seq, batch, seq);
    for (std::int64_t t0 = 0; t0 < seq; t0 += piece) {
      const std::int64_t n = std::min(piece, seq - t0);
      cache.append(layer, first_seq, part(kv, t0, n), part(vv, t0, n));
      // Bottom-right against each sequence's length.
      attention_decode(part(qv, t0, n), cache, layer, part(yv, t0, n), {}, o);
    }
  }
  if (rows <= kSmallRows) {  // O = [Y_1|…] W_O (4.5); its scratch was reserved above
    const Product o[] = {{w_o_.data(), c.d_model, out.data()}};
    small_gemm(rows, qw, y.data(), o, threads, ao.isa);
  } else {
    gemm(false, false, rows, c.d_model, qw, y.data(), w_o_.data(), out.data(),
         false);  // O = [Y_1|…] W_O
  }
}

void CausalSelfAttention::step(std::span<const float> u, std::int64_t batch, KVCache& cache,
                               std::int64_t layer, std::span<float> out, std::int64_t first_seq) {
  prefill(u, batch, 1, cache, layer, out, first_seq);
}

}  // namespace tokenmix
