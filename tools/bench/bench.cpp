// tools/bench/bench.cpp — see bench.hpp.
#include "bench.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <sstream>
#include <thread>

#include "api/variants.hpp"
#include "decode/kv_cache_access.hpp"
#include "kernels/dropout.hpp"
#include "kernels/kv_element.hpp"
#include "reference/reference.hpp"
#include "testkit.hpp"
#include "tokenmix/error.hpp"
#include "tokenmix/kv_cache.hpp"
#include "tokenmix/runtime.hpp"

namespace tokenmix::bench {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Peak-RSS probe: Linux resets VmHWM to the current RSS when "5" is written to clear_refs.
std::int64_t status_kib(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(std::string(key).size()));
  }
  return -1;
}
bool reset_peak_rss() {
  std::ofstream out("/proc/self/clear_refs");
  out << "5";
  return static_cast<bool>(out.flush());
}

using reference::Tensor64;
using testkit::random_normal;

/// Forward and backward cases: one shape per (T_q, threads, isa).
struct Case {
  testkit::AttentionShape shape;
  int threads;
  Isa isa;
};

}  // namespace

// A ceiling below the CPU's is said, not hidden: on stderr, once per process, when the first
// one is measured (after the arguments were checked: an error stays the one line on stderr).
void warn_sgemm_ceiling_once() {
  static const bool warned = [] {
    const std::string warning = sgemm_ceiling_warning();
    if (!warning.empty()) std::cerr << "[bench] warning: " << warning << "\n";
    return true;
  }();
  (void)warned;
}

std::vector<float> BenchVariants::alibi_slopes(std::int64_t H_q) const {
  std::vector<float> m;
  if (!alibi) return m;
  for (std::int64_t h = 0; h < H_q; ++h)
    m.push_back(static_cast<float>(
        std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(H_q))));
  return m;
}

std::vector<float> BenchVariants::sink_values(std::int64_t H_q) const {
  if (sinks.empty()) return {};
  if (sinks.size() != 1 && static_cast<std::int64_t>(sinks.size()) != H_q)
    throw ArgumentError(ErrorCode::shape_mismatch,
                        "--sinks has " + std::to_string(sinks.size()) +
                            " values; expected 1 (every head) or H_q = " + std::to_string(H_q) +
                            " (one per query head)");
  std::vector<float> s(static_cast<std::size_t>(H_q));
  for (std::int64_t h = 0; h < H_q; ++h)
    s[static_cast<std::size_t>(h)] =
        static_cast<float>(sinks.size() == 1 ? sinks[0] : sinks[static_cast<std::size_t>(h)]);
  return s;
}

std::string BenchVariants::describe() const {
  std::ostringstream os;
  os << std::setprecision(6);
  const char* sep = "";
  if (window) os << sep << "window=" << *window, sep = " ";
  if (softcap) os << sep << "softcap=" << *softcap, sep = " ";
  if (alibi) os << sep << "alibi", sep = " ";
  if (!sinks.empty()) {
    os << sep << "sinks=";
    for (std::size_t i = 0; i < sinks.size(); ++i) os << (i ? "," : "") << sinks[i];
    sep = " ";
  }
  if (dropout > 0.0) os << sep << "dropout=" << dropout;
  return os.str();
}

std::string BenchVariants::json() const {
  std::ostringstream os;
  os << std::setprecision(9) << ", \"window\": ";
  if (window)
    os << *window;
  else
    os << "null";
  os << ", \"softcap\": ";
  if (softcap)
    os << *softcap;
  else
    os << "null";
  os << ", \"alibi\": " << (alibi ? "true" : "false") << ", \"sinks\": ";
  if (sinks.empty()) {
    os << "null";
  } else {
    os << "[";
    for (std::size_t i = 0; i < sinks.size(); ++i) os << (i ? ", " : "") << sinks[i];
    os << "]";
  }
  os << ", \"dropout\": " << dropout;
  return os.str();
}

void BenchVariants::apply(AttentionOptions& o, const std::vector<float>& alibi_storage,
                          const std::vector<float>& sink_storage) const {
  o.window = window;
  o.softcap = softcap;
  auto vec = [](const std::vector<float>& v) {
    ConstTensorView t;
    if (v.empty()) return t;
    t.data = v.data();
    t.dtype = DType::f32;
    t.rank = 1;
    t.shape = {static_cast<std::int64_t>(v.size()), 1, 1, 1};
    t.strides = {1, 0, 0, 0};
    return t;
  };
  o.alibi_slopes = vec(alibi_storage);
  o.sinks = vec(sink_storage);
  o.dropout = {dropout, dropout_seed, 0};
}

std::int64_t windowed_pairs(std::int64_t T_q, std::int64_t T_k, bool causal, CausalAlign align,
                            std::optional<std::int64_t> window) {
  return window ? visible_pairs_windowed(T_q, T_k, causal, align, *window)
                : visible_pairs(T_q, T_k, causal, align);
}

double windowed_forward_flops(const testkit::AttentionShape& s,
                              std::optional<std::int64_t> window) {
  if (!window) return s.forward_flops();
  return forward_flops_windowed(s.B, s.T_q, s.T_k, s.H_q, s.d_h, s.causal, s.align, *window);
}

std::vector<std::int64_t> decode_lengths(std::int64_t B, std::int64_t T_k, bool mixed) {
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(B), T_k);
  if (!mixed) return lengths;
  std::mt19937_64 rng(kMixedLengthsSeed);  // its output sequence is fixed by the standard
  const std::int64_t h = T_k / 2;
  const auto span = static_cast<std::uint64_t>(2 * h + 1);
  for (std::int64_t& L : lengths) L = T_k - h + static_cast<std::int64_t>(rng() % span);
  return lengths;
}

AttentionRun::AttentionRun(const testkit::AttentionShape& shape, bool backward, Isa isa,
                           int threads, const BenchVariants& variants, DType dtype)
    : shape_(shape),
      backward_(backward),
      variants_(variants),
      alibi_(variants.alibi_slopes(shape.H_q)),
      sinks_(variants.sink_values(shape.H_q)),
      dtype_(dtype) {
  const std::int64_t B = shape.B, Hq = shape.H_q, Hkv = shape.H_kv, D = shape.d_h;
  q_ = random_normal(static_cast<std::size_t>(B * shape.T_q * Hq * D), 11);
  k_ = random_normal(static_cast<std::size_t>(B * shape.T_k * Hkv * D), 12);
  v_ = random_normal(k_.size(), 13);
  o_.assign(q_.size(), 0.0f);
  lse_.assign(static_cast<std::size_t>(B * Hq * shape.T_q), 0.0f);
  if (backward) {
    dout_ = random_normal(q_.size(), 14);
    dq_.assign(q_.size(), 0.0f);
    dk_.assign(k_.size(), 0.0f);
    dv_.assign(k_.size(), 0.0f);
  }
  options_.causal = shape.causal;
  options_.align = shape.align;
  options_.threads = threads;
  options_.isa = isa;
  variants_.apply(options_, alibi_, sinks_);
  if (dtype_ == DType::f32) return;
  if (dtype_ != DType::bf16 && dtype_ != DType::f16)
    throw ArgumentError(ErrorCode::invalid_argument, "bench: --dtype must be f32, bf16 or f16");
  // Round the inputs to the dtype; the float copies keep the rounded values (for the oracle).
  const auto to16 = [&](std::vector<float>& x32, std::vector<std::uint16_t>& x16) {
    x16.resize(x32.size());
    for (std::size_t i = 0; i < x32.size(); ++i) {
      kernels::store_element(dtype_, x16.data(), static_cast<std::int64_t>(i), x32[i]);
      x32[i] = kernels::load_element(dtype_, x16.data(), static_cast<std::int64_t>(i));
    }
  };
  to16(q_, q16_);
  to16(k_, k16_);
  to16(v_, v16_);
  to16(o_, o16_);
  if (backward) {
    to16(dout_, dout16_);
    to16(dq_, dq16_);
    to16(dk_, dk16_);
    to16(dv_, dv16_);
  }
}

template <class V>
V AttentionRun::view(std::vector<float>& x32, std::vector<std::uint16_t>& x16, std::int64_t T,
                     std::int64_t H) const {
  const testkit::AttentionShape& s = shape_;
  V x = V::bthd(x32.data(), s.B, T, H, s.d_h);
  if (dtype_ != DType::f32) {
    x.data = x16.data();
    x.dtype = dtype_;
  }
  return x;
}

void AttentionRun::forward() {
  const testkit::AttentionShape& s = shape_;
  auto* self = const_cast<AttentionRun*>(this);  // views of the members (inputs stay unchanged)
  using CV = ConstTensorView;
  attention_forward(self->view<CV>(self->q_, self->q16_, s.T_q, s.H_q),
                    self->view<CV>(self->k_, self->k16_, s.T_k, s.H_kv),
                    self->view<CV>(self->v_, self->v16_, s.T_k, s.H_kv),
                    view<TensorView>(o_, o16_, s.T_q, s.H_q),
                    TensorView::bht(lse_.data(), s.B, s.H_q, s.T_q), options_);
}

void AttentionRun::call() {
  if (!backward_) return forward();
  const testkit::AttentionShape& s = shape_;
  using CV = ConstTensorView;
  attention_backward(
      view<CV>(q_, q16_, s.T_q, s.H_q), view<CV>(k_, k16_, s.T_k, s.H_kv),
      view<CV>(v_, v16_, s.T_k, s.H_kv), view<CV>(o_, o16_, s.T_q, s.H_q),
      ConstTensorView::bht(lse_.data(), s.B, s.H_q, s.T_q), view<CV>(dout_, dout16_, s.T_q, s.H_q),
      view<TensorView>(dq_, dq16_, s.T_q, s.H_q), view<TensorView>(dk_, dk16_, s.T_k, s.H_kv),
      view<TensorView>(dv_, dv16_, s.T_k, s.H_kv), options_);
}

double AttentionRun::useful_flops() const {
  const double fwd = windowed_forward_flops(shape_, variants_.window);
  return backward_ ? 2.5 * fwd : fwd;
}

namespace {
// The oracle's options for the variants, for the query heads [h0, h0 + n) of a slice.
void reference_variants(reference::Options& ro, const BenchVariants& v,
                        const std::vector<float>& alibi, const std::vector<float>& sinks,
                        std::int64_t h0, std::int64_t n) {
  ro.window = v.window;
  ro.softcap = v.softcap;
  for (std::int64_t h = h0; h < h0 + n; ++h) {
    if (!alibi.empty()) ro.alibi_slopes.push_back(alibi[static_cast<std::size_t>(h)]);
    if (!sinks.empty()) ro.sinks.push_back(sinks[static_cast<std::size_t>(h)]);
  }
}

// The dropout keep mask Z of the rows [t0, t0 + R) of batch row 0 and query heads [0, g) of a
// call with H_q heads (the slice the oracle checks), dense [1][g][R][T_k] for reference::Options:
// the library's scalar generator (kernels/dropout.hpp), as attention_dropout_mask draws it.
void reference_dropout(reference::Options& ro, const BenchVariants& v, std::int64_t Hq,
                       std::int64_t g, std::int64_t t0, std::int64_t R, std::int64_t Tq,
                       std::int64_t Tk) {
  if (!(v.dropout > 0.0)) return;
  const kernels::Dropout z =
      detail::checked_dropout("tokenmix bench", {v.dropout, v.dropout_seed, 0}, 1, Hq, Tq, Tk);
  ro.dropout_p = v.dropout;
  ro.dropout_keep.reserve(static_cast<std::size_t>(g * R * Tk));
  for (std::int64_t h = 0; h < g; ++h)
    for (std::int64_t t = t0; t < t0 + R; ++t)
      for (std::int64_t u = 0; u < Tk; ++u) ro.dropout_keep.push_back(z.keep(0, h, t, u) ? 1 : 0);
}
}  // namespace

// Error on a slice: batch 0, the g query heads of KV head 0, R query rows — the last R for
// bottom-right alignment (they see the most keys), the first R for top-left — against the
// float64 oracle. For causal bottom-right with T_q = T_k the last R keys are seen only by those
// rows, so dK/dV of those keys are checked exactly too.
double AttentionRun::slice_error() const {
  const std::int64_t Tq = shape_.T_q, Tk = shape_.T_k, Hq = shape_.H_q, Hkv = shape_.H_kv,
                     D = shape_.d_h;
  const std::int64_t g = Hq / Hkv, R = std::min<std::int64_t>(Tq, 32);
  const bool last_rows = shape_.align == CausalAlign::bottom_right;
  const std::int64_t t0 = last_rows ? Tq - R : 0;
  reference::Options ro;
  ro.causal = shape_.causal;
  ro.align = testkit::to_reference(shape_.align);
  reference_variants(ro, variants_, alibi_, sinks_, 0, g);
  reference_dropout(ro, variants_, Hq, g, t0, R, Tq, Tk);
  const Tensor64 q64 = testkit::slice64(q_, 1, Tq, Hq, D, t0, R, 0, g);
  const Tensor64 k64 = testkit::slice64(k_, 1, Tk, Hkv, D, 0, Tk, 0, 1);
  const Tensor64 v64 = testkit::slice64(v_, 1, Tk, Hkv, D, 0, Tk, 0, 1);
  // Outputs as fp32: bf16/f16 ones widened (exactly) from what the call wrote.
  const auto wide = [&](const std::vector<float>& x32, const std::vector<std::uint16_t>& x16) {
    if (dtype_ == DType::f32) return x32;
    std::vector<float> x(x16.size());
    for (std::size_t i = 0; i < x.size(); ++i)
      x[i] = kernels::load_element(dtype_, x16.data(), static_cast<std::int64_t>(i));
    return x;
  };
  const std::vector<float> o_ = wide(this->o_, o16_), dq_ = wide(this->dq_, dq16_),
                           dk_ = wide(this->dk_, dk16_), dv_ = wide(this->dv_, dv16_);
  auto at = [](const std::vector<float>& x, std::int64_t i) {
    return static_cast<double>(x[static_cast<std::size_t>(i)]);
  };
  testkit::ErrorAccumulator err;
  if (!backward_) {
    const auto ref = reference::attention_forward(q64, k64, v64, ro);
    for (std::int64_t t = 0; t < R; ++t)
      for (std::int64_t h = 0; h < g; ++h)
        for (std::int64_t d = 0; d < D; ++d)
          err.add(at(o_, ((t0 + t) * Hq + h) * D + d), ref.out.at(0, t, h, d));
  } else {
    const Tensor64 do64 = testkit::slice64(dout_, 1, Tq, Hq, D, t0, R, 0, g);
    const auto ref = reference::attention_backward(q64, k64, v64, do64, ro);
    for (std::int64_t t = 0; t < R; ++t)
      for (std::int64_t h = 0; h < g; ++h)
        for (std::int64_t d = 0; d < D; ++d)
          err.add(at(dq_, ((t0 + t) * Hq + h) * D + d), ref.dq.at(0, t, h, d));
    if (shape_.causal && last_rows && Tq == Tk) {
      for (std::int64_t u = Tk - R; u < Tk; ++u)
        for (std::int64_t d = 0; d < D; ++d) {
          err.add(at(dk_, (u * Hkv) * D + d), ref.dk.at(0, u, 0, d));
          err.add(at(dv_, (u * Hkv) * D + d), ref.dv.at(0, u, 0, d));
        }
    }
  }
  return err.value();
}

std::string to_json(const BenchResult& r) {
  std::ostringstream os;
  os << std::setprecision(6) << "{\"op\": \"" << r.op << "\", \"batch\": " << r.batch
     << ", \"tq\": " << r.tq << ", \"tk\": " << r.tk << ", \"hq\": " << r.hq
     << ", \"hkv\": " << r.hkv << ", \"dh\": " << r.dh << ", \"threads\": " << r.threads
     << ", \"isa\": \"" << r.isa << "\", \"causal\": " << (r.causal ? "true" : "false")
     << ", \"align\": \"" << r.align << "\", \"dtype\": \"" << r.dtype << "\", \"ceiling_kind\": \""
     << r.ceiling_kind << "\", \"sgemm_core\": \"" << r.sgemm_core
     << "\", \"seconds\": " << r.seconds << ", \"gflops\": " << r.gflops
     << ", \"ceiling_gflops\": " << r.ceiling_gflops << ", \"ratio\": " << r.ratio
     << ", \"max_rel_err\": " << r.max_rel_err << ", \"extra_bytes\": " << r.extra_bytes
     << r.variants.json();
  if (r.op != "decode") {
    os << ", \"ceiling_min\": " << r.ceiling_min << ", \"ceiling_max\": " << r.ceiling_max;
  } else {
    os << ", \"cache_dtype\": \"" << r.cache_dtype << "\", \"gbps\": " << r.gbps
       << ", \"ceiling_gbps\": " << r.ceiling_gbps << ", \"tokens_per_s\": " << r.tokens_per_s
       << ", \"err_vs_unquantized\": " << r.err_vs_unquantized
       << ", \"kv_outlier\": " << r.kv_outlier << ", \"kv_profile\": \"" << r.kv_profile
       << "\", \"ceiling_gbps_kind\": \"" << r.ceiling_gbps_kind
       << "\", \"ratio_gflops\": " << r.ratio_gflops << ", \"kv_bytes\": " << r.kv_bytes
       << ", \"flops\": " << std::setprecision(17) << r.flops << std::setprecision(6)
       << ", \"roofline_ms\": " << r.roofline_ms << ", \"ratio_roofline\": " << r.ratio_roofline
       << ", \"seconds_min\": " << r.seconds_min << ", \"seconds_max\": " << r.seconds_max
       << ", \"lengths\": \"" << r.lengths << "\", \"cache_tokens_total\": " << r.cache_tokens_total
       << ", \"cache_tokens_min\": " << r.cache_tokens_min
       << ", \"cache_tokens_max\": " << r.cache_tokens_max << ", \"rounds\": " << r.rounds;
  }
  os << ", \"cpu\": \"" << cpu_features().model << "\"}";
  return os.str();
}

namespace {
// One line per case: JSON, or a table row (decode rows show bytes/s, the others FLOP/s).
void print_result(std::ostream& out, const BenchResult& r, bool json) {
  if (json) {
    out << to_json(r) << "\n";
    return;
  }
  char line[320];
  const double extra_mib = r.extra_bytes < 0 ? -1.0 : r.extra_bytes / 1048576.0;
  if (r.op == "decode") {
    std::snprintf(line, sizeof line,
                  "  %-8s %4lld %5lld %6lld %8lld %4lld %4lld %3lld %3d %-7s %-8s %8.2f %7.1f "
                  "%7.1f %6.3f %8.1f %7.1f %8.3f %6.3f %12.2e %10.1f\n",
                  "decode", static_cast<long long>(r.batch), static_cast<long long>(r.tq),
                  static_cast<long long>(r.tk), static_cast<long long>(r.cache_tokens_total),
                  static_cast<long long>(r.hq), static_cast<long long>(r.hkv),
                  static_cast<long long>(r.dh), r.threads, r.isa.c_str(), r.cache_dtype.c_str(),
                  r.seconds * 1e3, r.gbps, r.ceiling_gbps, r.ratio, r.gflops, r.ceiling_gflops,
                  r.roofline_ms, r.ratio_roofline, r.max_rel_err, extra_mib);
  } else {
    std::snprintf(line, sizeof line,
                  "  %-8s %4lld %6lld %6lld %4lld %4lld %3lld %3d %-7s %9.2f %9.1f %6.1f %6.3f "
                  "%12.2e %10.1f   ceiling %.1f-%.1f\n",
                  r.op.c_str(), static_cast<long long>(r.batch), static_cast<long long>(r.tq),
                  static_cast<long long>(r.tk), static_cast<long long>(r.hq),
                  static_cast<long long>(r.hkv), static_cast<long long>(r.dh), r.threads,
                  r.isa.c_str(), r.seconds * 1e3, r.gflops, r.ceiling_gflops, r.ratio,
                  r.max_rel_err, extra_mib, r.ceiling_min, r.ceiling_max);
  }
  out << line;
}
}  // namespace

namespace {

// A list option's values: at least one, each >= 1 (ArgumentError naming the option otherwise).
void check_positive_list(const char* name, const std::vector<std::int64_t>& values) {
  if (values.empty())
    throw ArgumentError(ErrorCode::invalid_argument,
                        std::string("bench: ") + name + " needs at least one value; got none");
  for (std::int64_t v : values)
    if (v < 1)
      throw ArgumentError(
          ErrorCode::invalid_argument,
          std::string("bench: ") + name + " values must be >= 1; got " + std::to_string(v));
}

// `tokenmix bench decode`: one attention_decode step (T_new queries per sequence) against a
// contiguous KVCache holding L_b positions in sequence b (all T_k, or decode_lengths' mixed
// ones), for each (B, T_new, T_k, cache dtype, threads, isa). Reports K/V bytes read per second
// next to the streaming read bandwidth and the useful GFLOP/s next to forward's sgemm ceiling,
// both measured in passes interleaved with the timed steps (an sgemm pass, a read pass, a step;
// the median of each), the roofline time of the two, and the max relative error of the group of
// KV head 0 (sequence 0) vs float64. The sgemm ceiling was once measured when a thread count was
// first used, so a case minutes later was set against the machine as it had been then: on a
// shared 2-vCPU Xeon the two-thread sgemm read 300 to 449 GFLOP/s within one session, the FMA
// peak of a core 155 to 222 (docs/performance.md, D-bench-5), and ratio_roofline moved with it.
// Slow phases of such a host last minutes and took whole runs of consecutive cases (AMD Zen 4,
// D-bench-6: the AVX2 T_new = 8 step at 34.9 ms in a table, 23.3 ms minutes later): --rounds N
// visits the case list N times, round-robin, and reports each case from all its samples.
std::vector<BenchResult> run_decode(const BenchConfig& cfg, std::ostream& out) {
  check_positive_list("--tnew", cfg.tnew);
  check_positive_list("--cache-tokens", cfg.cache_tokens);
  const bool mixed = cfg.lengths == "mixed";
  if (cfg.hq % cfg.hkv != 0)
    throw ArgumentError(ErrorCode::invalid_argument, "bench: --hkv must divide --hq");
  if (cfg.variants.dropout > 0.0) {
    throw UnsupportedError(
        "bench decode: --dropout applies to the forward and backward cases (KV-cache decode "
        "serves inference and has no dropout)");
  }
  if (!(std::isfinite(cfg.kv_outlier) && cfg.kv_outlier > 0.0)) {
    throw ArgumentError(
        ErrorCode::invalid_argument,
        "bench: --kv-outlier must be a finite number > 0; got " + std::to_string(cfg.kv_outlier));
  }
  if (cfg.kv_profile != "normal" && cfg.kv_profile != "real") {
    throw ArgumentError(ErrorCode::invalid_argument,
                        "bench: --kv-profile must be normal or real; got '" + cfg.kv_profile + "'");
  }
  struct DecodeCase {
    std::int64_t batch, tnew, tk;
    DType dtype;
    int threads;
    Isa isa;
  };
  std::vector<DecodeCase> cases;
  for (std::int64_t B : cfg.batch)
    for (std::int64_t Tn : cfg.tnew)
      for (std::int64_t tk : cfg.cache_tokens)
        for (DType dt : cfg.cache_dtypes)
          for (int th : cfg.threads)
            for (Isa isa : cfg.isas) {
              if (th < 0)
                throw ArgumentError(ErrorCode::invalid_argument,
                                    "bench: --threads must be >= 0; got " + std::to_string(th));
              cases.push_back({B, Tn, tk, dt, th == 0 ? default_threads() : th, resolve_isa(isa)});
            }
  if (!cfg.json) {
    out << "tokenmix bench decode on " << cpu_features().model << "\n";
    out << "  sgemm ceiling: OpenBLAS " << sgemm_core() << " kernel\n";
    if (cfg.variants.any()) out << "  variants: " << cfg.variants.describe() << "\n";
    if (mixed) {
      out << "  lengths: mixed, sequence b holds L_b uniform in [T_k - T_k/2, T_k + T_k/2] "
             "(std::mt19937_64, seed "
          << kMixedLengthsSeed << "); sum_T_k = sum of the L_b\n";
    }
    char head[320];
    std::snprintf(head, sizeof head,
                  "  %-8s %4s %5s %6s %8s %4s %4s %3s %3s %-7s %-8s %8s %7s %7s %6s %8s %7s %8s "
                  "%6s %12s %10s\n",
                  "op", "B", "T_new", "T_k", "sum_T_k", "H_q", "H_kv", "d_h", "thr", "isa", "cache",
                  "ms", "GB/s", "ceiling", "ratio", "GFLOP/s", "sgemm", "roof_ms", "r_roof",
                  "max_rel_err", "extra_MiB");
    out << head;
  }
  const std::int64_t Hq = cfg.hq, Hkv = cfg.hkv, D = cfg.dh, g = Hq / Hkv;
  std::vector<BenchResult> results;
  std::optional<StreamRead> stream;     // cfg.read_mib (1 GiB), allocated once
  std::optional<SgemmCeiling> sgemm;    // the fp32 GEMM ceiling's operands, allocated once
  constexpr std::int64_t kFill = 4096;  // positions appended per call while filling the cache
  // K/V rows [B, kFill, H_kv, d_h] (regenerated when B changes; sequence b's rows are the same
  // for any B) and the queries [B, T_new, H_q, d_h] (when B or T_new changes).
  std::int64_t B = 0, Tn = 0;
  std::vector<float> kv_k, kv_v, q, o, lse;
  std::vector<std::uint16_t> q16, o16;
  // --dtype bf16/f16: the queries and outputs in that dtype (q keeps the rounded values).
  const DType qdt = cfg.dtype;
  // Each case's timed steps and ceiling passes, pooled over the rounds (BenchConfig::rounds):
  // visit v is case v % cases of round v / cases.
  struct Samples {
    std::vector<double> times, ceiling, ceiling_gflops;
  };
  std::vector<Samples> samples(cases.size());
  const std::size_t visits = cases.size() * static_cast<std::size_t>(cfg.rounds);
  for (std::size_t visit = 0; visit < visits; ++visit) {
    const std::size_t ci = visit % cases.size();
    const std::size_t round = visit / cases.size();
    const bool last_round = round + 1 == static_cast<std::size_t>(cfg.rounds);
    const DecodeCase& c = cases[ci];
    if (c.batch != B) {
      B = c.batch;
      Tn = 0;
      kv_k = random_normal(static_cast<std::size_t>(B * kFill * Hkv * D), 21);
      kv_v = random_normal(kv_k.size(), 22);
      if (cfg.kv_profile == "real") {
        for (std::int64_t b = 0; b < B; ++b) {
          std::vector<float> rows(kv_k.begin() + b * kFill * Hkv * D,
                                  kv_k.begin() + (b + 1) * kFill * Hkv * D);
          testkit::apply_real_keys(rows, kFill, Hkv, D, 31);
          std::copy(rows.begin(), rows.end(), kv_k.begin() + b * kFill * Hkv * D);
        }
      }
      for (std::size_t i = 0; i < kv_k.size(); i += static_cast<std::size_t>(D)) {  // channel 0
        kv_k[i] = static_cast<float>(kv_k[i] * cfg.kv_outlier);
        kv_v[i] = static_cast<float>(kv_v[i] * cfg.kv_outlier);
      }
    }
    if (c.tnew != Tn) {
      Tn = c.tnew;
      q = random_normal(static_cast<std::size_t>(B * Tn * Hq * D), 23);
      o.assign(q.size(), 0.0f);
      lse.assign(static_cast<std::size_t>(B * Hq * Tn), 0.0f);
      q16.assign(qdt == DType::f32 ? 0 : q.size(), 0);
      o16.assign(q16.size(), 0);
      for (std::size_t i = 0; i < q16.size(); ++i) {
        kernels::store_element(qdt, q16.data(), static_cast<std::int64_t>(i), q[i]);
        q[i] = kernels::load_element(qdt, q16.data(), static_cast<std::int64_t>(i));
      }
    }
    if (!stream) {
      if (cfg.progress) {
        std::cerr << "[bench] allocating the " << cfg.read_mib
                  << " MiB streaming-read buffer (the ceiling)\n";
      }
      stream.emplace(static_cast<std::size_t>(cfg.read_mib) << 20);
      // The ceiling's warning (a kernel without AVX-512), once, after the arguments were checked.
      const std::string warning = sgemm_ceiling_warning();
      if (!warning.empty()) std::cerr << "[bench] warning: " << warning << "\n";
      sgemm.emplace(cfg.gemm_n);
    }
    if (cfg.progress) {
      std::cerr << "[bench] decode B=" << B << " T_new=" << Tn << " T_k=" << c.tk
                << (mixed ? " (mixed)" : "") << " cache=" << to_string(c.dtype)
                << " threads=" << c.threads << " isa=" << to_string(c.isa);
      if (cfg.rounds > 1) std::cerr << " round " << round + 1 << "/" << cfg.rounds;
      std::cerr << "\n";
    }
    const std::vector<std::int64_t> lengths = decode_lengths(B, c.tk, mixed);
    const std::int64_t longest = *std::max_element(lengths.begin(), lengths.end());
    KVCache cache({1, B, Hkv, D, longest, c.dtype, 0, 0});
    for (std::int64_t b = 0; b < B; ++b) {  // sequence b: its rows of the repeating pattern
      const std::int64_t L = lengths[static_cast<std::size_t>(b)];
      const float* kb = kv_k.data() + b * kFill * Hkv * D;
      const float* vb = kv_v.data() + b * kFill * Hkv * D;
      for (std::int64_t t0 = 0; t0 < L; t0 += kFill) {  // the 4096-position pattern repeats
        const std::int64_t n = std::min(kFill, L - t0);
        const std::array<std::int64_t, 4> st{kFill * Hkv * D, Hkv * D, D, 1};
        cache.append(0, b, ConstTensorView{kb, DType::f32, 4, {1, n, Hkv, D}, st},
                     ConstTensorView{vb, DType::f32, 4, {1, n, Hkv, D}, st});
      }
    }
    DecodeOptions opt;
    opt.threads = c.threads;
    opt.isa = c.isa;
    const std::vector<float> alibi = cfg.variants.alibi_slopes(Hq),
                             sinks = cfg.variants.sink_values(Hq);
    {
      AttentionOptions ao;  // the same views, through the one helper
      cfg.variants.apply(ao, alibi, sinks);
      opt.window = ao.window;
      opt.softcap = ao.softcap;
      opt.alibi_slopes = ao.alibi_slopes;
      opt.sinks = ao.sinks;
    }
    auto Q = ConstTensorView::bthd(q.data(), B, Tn, Hq, D);
    auto O = TensorView::bthd(o.data(), B, Tn, Hq, D);
    if (qdt != DType::f32) {
      Q.data = q16.data();
      Q.dtype = qdt;
      O.data = o16.data();
      O.dtype = qdt;
    }
    const auto L = TensorView::bht(lse.data(), B, Hq, Tn);
    attention_decode(Q, cache, 0, O, L, opt);  // warm-up
    (void)sgemm->pass_gflops(c.threads, 1);
    std::this_thread::sleep_for(std::chrono::milliseconds(kAfterSgemmMs));
    (void)stream->pass_gbps(c.threads);
    const std::int64_t rss_before = status_kib("VmRSS:");
    const bool peak_ok = reset_peak_rss();
    auto& [times, ceiling, ceiling_gflops] = samples[ci];  // this case's, over the rounds
    for (int r = 0; r < cfg.repeats; ++r) {  // the ceilings' passes, then a step: same conditions
      ceiling_gflops.push_back(sgemm->pass_gflops(c.threads, 2));
      // OpenBLAS's spinning workers go idle before the read pass (kAfterSgemmMs, D-bench-5).
      std::this_thread::sleep_for(std::chrono::milliseconds(kAfterSgemmMs));
      ceiling.push_back(stream->pass_gbps(c.threads));
      const auto t0 = Clock::now();
      attention_decode(Q, cache, 0, O, L, opt);
      times.push_back(seconds_since(t0));
    }
    const std::int64_t peak = status_kib("VmHWM:");
    if (!last_round) continue;  // the result from every round's samples, after the last one
    BenchResult res{};
    res.op = "decode";
    res.rounds = cfg.rounds;
    res.batch = B;
    res.tq = Tn;
    res.tk = c.tk;
    res.hq = Hq;
    res.hkv = Hkv;
    res.dh = D;
    res.threads = c.threads;
    res.isa = to_string(c.isa);
    res.causal = true;
    res.align = "bottom-right";
    res.seconds = median(times);
    const auto [fastest, slowest] = std::minmax_element(times.begin(), times.end());
    res.seconds_min = *fastest;
    res.seconds_max = *slowest;
    res.lengths = cfg.lengths;
    res.cache_tokens_total = 0;
    for (std::int64_t len : lengths) res.cache_tokens_total += len;
    res.cache_tokens_min = *std::min_element(lengths.begin(), lengths.end());
    res.cache_tokens_max = longest;
    // Useful work: the pairs the T_new queries of each sequence see (bottom-right, SPEC
    // "Useful-work counts"), only the window's with one; bytes: what the step reads
    // (decode_bytes, window-aware, each sequence's own length).
    std::int64_t pairs = 0;
    for (std::int64_t len : lengths)
      pairs += windowed_pairs(Tn, len, true, CausalAlign::bottom_right, cfg.variants.window);
    res.flops = 4.0 * static_cast<double>(D) * static_cast<double>(Hq) * static_cast<double>(pairs);
    res.gflops = res.flops / res.seconds * 1e-9;
    res.ceiling_gflops = median(ceiling_gflops);
    res.ratio_gflops = res.gflops / res.ceiling_gflops;
    res.dtype = to_string(qdt);
    res.ceiling_kind = sgemm->kind();
    res.sgemm_core = sgemm_core();
    res.ceiling_gbps_kind = stream->kind();
    for (std::size_t i = 0; i < o16.size(); ++i)  // bf16/f16 outputs widened for the error
      o[i] = kernels::load_element(qdt, o16.data(), static_cast<std::int64_t>(i));
    res.cache_dtype = to_string(c.dtype);
    res.kv_bytes = decode_bytes(cache, 0, 0, B, cfg.variants.window.value_or(0), Tn);
    res.gbps = static_cast<double>(res.kv_bytes) / res.seconds * 1e-9;
    res.variants = cfg.variants;
    res.ceiling_gbps = median(ceiling);
    res.ratio = res.gbps / res.ceiling_gbps;
    // Roofline: the step can take no less than its bytes at the read ceiling, nor its useful
    // FLOPs at the sgemm ceiling.
    res.roofline_ms = 1e3 * std::max(static_cast<double>(res.kv_bytes) / (res.ceiling_gbps * 1e9),
                                     res.flops / (res.ceiling_gflops * 1e9));
    res.ratio_roofline = res.roofline_ms / (res.seconds * 1e3);
    res.tokens_per_s = static_cast<double>(B * Tn) / res.seconds;
    res.extra_bytes = peak_ok && peak >= 0 && rss_before >= 0
                          ? std::max<std::int64_t>(0, peak - rss_before) * 1024
                          : -1;

    // Error: sequence 0 (its L_0 positions), the g query heads of KV head 0, against the float64
    // oracle on the values as stored (fp32 rounded to the cache dtype; int8 / fp8: each row
    // quantized as the cache does and dequantized in float64, SPEC "Quantized KV cache").
    const std::int64_t L0 = lengths[0];
    const Tensor64 q64 = testkit::slice64(q, 1, Tn, Hq, D, 0, Tn, 0, g);
    Tensor64 k64({1, L0, 1, D}), v64({1, L0, 1, D});
    auto rounded = [&](float x) {  // as the cache stores it (round to nearest even), widened
      std::uint32_t slot = 0;
      kernels::store_element(c.dtype, &slot, 0, x);
      return static_cast<double>(kernels::load_element(c.dtype, &slot, 0));
    };
    const bool quantized = kernels::is_quantized(c.dtype);
    std::vector<double> kr(static_cast<std::size_t>(D)), vr(kr.size());
    for (std::int64_t t = 0; t < L0; ++t) {
      const std::size_t row = static_cast<std::size_t>(((t % kFill) * Hkv) * D);
      if (quantized) {  // the values the cache holds (K per channel per tile, V per row)
        detail::KVCacheAccess::cached_row(cache, 0, 0, t, 0, false, kr.data());
        detail::KVCacheAccess::cached_row(cache, 0, 0, t, 0, true, vr.data());
        for (std::int64_t x = 0; x < D; ++x) {
          k64.at(0, t, 0, x) = kr[static_cast<std::size_t>(x)];
          v64.at(0, t, 0, x) = vr[static_cast<std::size_t>(x)];
        }
        continue;
      }
      for (std::int64_t x = 0; x < D; ++x) {
        k64.at(0, t, 0, x) = rounded(kv_k[row + static_cast<std::size_t>(x)]);
        v64.at(0, t, 0, x) = rounded(kv_v[row + static_cast<std::size_t>(x)]);
      }
    }
    reference::Options ro;
    reference_variants(ro, cfg.variants, alibi, sinks, 0, g);
    const auto ref = reference::attention_forward(q64, k64, v64, ro);
    res.max_rel_err =
        testkit::rel_err(testkit::slice64(o, 1, Tn, Hq, D, 0, Tn, 0, g).data, ref.out.data);
    // The same against the unrounded K/V: what the cache's dtype costs.
    for (std::int64_t t = 0; t < L0; ++t)
      for (std::int64_t x = 0; x < D; ++x) {
        const std::size_t src = static_cast<std::size_t>(((t % kFill) * Hkv) * D + x);
        k64.at(0, t, 0, x) = kv_k[src];
        v64.at(0, t, 0, x) = kv_v[src];
      }
    const auto exact = reference::attention_forward(q64, k64, v64, ro);
    res.err_vs_unquantized =
        testkit::rel_err(testkit::slice64(o, 1, Tn, Hq, D, 0, Tn, 0, g).data, exact.out.data);
    res.kv_outlier = cfg.kv_outlier;
    res.kv_profile = cfg.kv_profile;
    results.push_back(res);
    print_result(out, res, cfg.json);
    out.flush();
  }
  return results;
}

}  // namespace

std::vector<BenchResult> run(const BenchConfig& cfg, std::ostream& out) {
  if (cfg.op != "forward" && cfg.op != "backward" && cfg.op != "decode") {
    throw ArgumentError(ErrorCode::invalid_argument,
                        "bench: op must be forward, backward or decode; got '" + cfg.op + "'");
  }
  check_positive_list("--batch", cfg.batch);
  for (auto [name, v] : {std::pair{"--hq", cfg.hq}, std::pair{"--hkv", cfg.hkv},
                         std::pair{"--dh", cfg.dh}, std::pair{"--tk", cfg.tk + 1}}) {
    if (v < 1)
      throw ArgumentError(ErrorCode::invalid_argument,
                          std::string("bench: ") + name + " must be >= 1");
  }
  if (cfg.repeats < 1)
    throw ArgumentError(ErrorCode::invalid_argument, "bench: --repeats must be >= 1");
  if (cfg.rounds < 1) {
    throw ArgumentError(ErrorCode::invalid_argument,
                        "bench: --rounds must be >= 1; got " + std::to_string(cfg.rounds));
  }
  if (cfg.rounds != 1 && cfg.op != "decode") {
    throw ArgumentError(ErrorCode::invalid_argument,
                        "bench: --rounds applies only to decode (its cases are revisited "
                        "round-robin); got op " +
                            cfg.op + " with --rounds " + std::to_string(cfg.rounds));
  }
  if (cfg.lengths != "equal" && cfg.lengths != "mixed") {
    throw ArgumentError(ErrorCode::invalid_argument,
                        "bench: --lengths must be equal or mixed; got '" + cfg.lengths + "'");
  }
  if (cfg.lengths == "mixed" && cfg.op != "decode") {
    throw ArgumentError(ErrorCode::invalid_argument,
                        "bench: --lengths mixed applies only to decode (its KV cache holds one "
                        "length per sequence); got op " +
                            cfg.op);
  }
  if (cfg.read_mib < 1 || cfg.read_mib > (std::int64_t{1} << 20)) {
    throw ArgumentError(
        ErrorCode::invalid_argument,
        "bench: --read-mib must be in [1, 1048576]; got " + std::to_string(cfg.read_mib));
  }
  if (cfg.read_mib != BenchConfig{}.read_mib && cfg.op != "decode") {
    throw ArgumentError(ErrorCode::invalid_argument,
                        "bench: --read-mib applies only to decode (its streaming-read ceiling); "
                        "got op " +
                            cfg.op);
  }
  (void)gemm_ceiling_choice(cfg.dtype, cfg.gemm_n);  // --gemm-n in range, before any work
  (void)cfg.variants.sink_values(cfg.hq);  // --sinks: 1 or H_q values, checked before any work
  if (cfg.op == "decode") return run_decode(cfg, out);
  const bool backward = cfg.op == "backward";
  std::vector<Case> cases;
  for (std::int64_t B : cfg.batch)
    for (std::int64_t tq : cfg.tq)
      for (int th : cfg.threads)
        for (Isa isa : cfg.isas) {
          if (tq < 1) throw ArgumentError(ErrorCode::invalid_argument, "bench: --tq must be >= 1");
          if (th < 0)
            throw ArgumentError(ErrorCode::invalid_argument, "bench: --threads must be >= 0");
          const testkit::AttentionShape shape{
              B, tq, cfg.tk > 0 ? cfg.tk : tq, cfg.hq, cfg.hkv, cfg.dh, cfg.causal, cfg.align};
          cases.push_back({shape, th == 0 ? default_threads() : th, resolve_isa(isa)});
        }

  if (!cfg.json) {
    out << "tokenmix bench " << cfg.op << " (" << to_string(cfg.dtype) << ") on "
        << cpu_features().model << "\n";
    if (const GemmCeilingChoice choice = gemm_ceiling_choice(cfg.dtype, cfg.gemm_n);
        !choice.bf16_gemm) {
      out << "  sgemm ceiling: OpenBLAS " << sgemm_core() << " kernel\n";
      if (cfg.dtype == DType::bf16) out << "  ceiling: " << choice.kind << "\n";
    }
    if (cfg.variants.any()) out << "  variants: " << cfg.variants.describe() << "\n";
    char head[256];
    std::snprintf(head, sizeof head,
                  "  %-8s %4s %6s %6s %4s %4s %3s %3s %-7s %9s %9s %6s %6s %12s %10s\n", "op", "B",
                  "T_q", "T_k", "H_q", "H_kv", "d_h", "thr", "isa", "ms", "GFLOP/s", "ceil",
                  "ratio", "max_rel_err", "extra_MiB");
    out << head;
  }
  // The ceiling of the dtype (gemm_ceiling_choice): bf16 GEMM (oneDNN) for bf16 where the CPU
  // has bf16 GEMM instructions, measured once per thread count; sgemm otherwise, measured in passes
  // interleaved with the case's timed calls (one pass of 2 calls after each), the median of the
  // passes reported with their spread: one slow pass on a shared machine decides no ratio
  // (D-bench-6 for decode; on the AMD Zen 3 guest the sgemm ceiling read 161 GFLOP/s in one run
  // and 84 minutes later, issue 58).
  const GemmCeilingChoice choice = gemm_ceiling_choice(cfg.dtype, cfg.gemm_n);
  const bool onednn = choice.bf16_gemm;
  std::map<int, double> onednn_ceilings;
  std::string ceiling_kind = choice.kind;
  std::optional<SgemmCeiling> sgemm;
  if (!onednn) {
    warn_sgemm_ceiling_once();
    sgemm.emplace(cfg.gemm_n);
  }
  std::vector<BenchResult> results;
  for (const Case& c : cases) {
    const testkit::AttentionShape& sh = c.shape;
    if (onednn && !onednn_ceilings.count(c.threads)) {
      if (cfg.progress) {
        std::cerr << "[bench] measuring the oneDNN bf16 GEMM 2048^3 ceiling, " << c.threads
                  << " thread(s)\n";
      }
      onednn_ceilings[c.threads] = bf16_gemm_ceiling_gflops(c.threads, ceiling_kind);
    }
    if (cfg.progress) {
      std::cerr << "[bench] " << cfg.op << " B=" << sh.B << " T_q=" << sh.T_q << " T_k=" << sh.T_k
                << " threads=" << c.threads << " isa=" << to_string(c.isa) << "\n";
    }
    AttentionRun run(sh, backward, c.isa, c.threads, cfg.variants, cfg.dtype);
    if (sgemm) sgemm->best_gflops(c.threads, 1);  // its warm-up, before the memory is measured
    // Peak extra memory: resident-set growth over every call of this case (for backward, the
    // forward that produces O and L too), measured from here, where all inputs and outputs are
    // allocated and touched, so only the kernels' own scratch counts.
    const std::int64_t rss_before = status_kib("VmRSS:");
    const bool peak_ok = reset_peak_rss();
    run.forward();
    std::vector<double> times, ceiling_passes;
    run.call();  // warm-up
    for (int r = 0; r < cfg.repeats; ++r) {
      const auto t0 = Clock::now();
      run.call();
      times.push_back(seconds_since(t0));
      if (sgemm) ceiling_passes.push_back(sgemm->pass_gflops(c.threads, 2));
    }
    if (!sgemm) ceiling_passes.push_back(onednn_ceilings[c.threads]);
    const std::int64_t peak = status_kib("VmHWM:");
    BenchResult res{};
    res.op = cfg.op;
    res.batch = sh.B;
    res.tq = sh.T_q;
    res.tk = sh.T_k;
    res.hq = sh.H_q;
    res.hkv = sh.H_kv;
    res.dh = sh.d_h;
    res.threads = c.threads;
    res.isa = to_string(c.isa);
    res.causal = sh.causal;
    res.align = sh.align_name();
    res.dtype = to_string(cfg.dtype);
    res.ceiling_kind = ceiling_kind;
    res.sgemm_core = sgemm_core();
    res.seconds = median(times);
    res.gflops = run.useful_flops() / res.seconds * 1e-9;
    const CeilingSpread spread = ceiling_spread(ceiling_passes);
    res.ceiling_gflops = spread.median;
    res.ceiling_min = spread.min;
    res.ceiling_max = spread.max;
    res.ratio = res.gflops / res.ceiling_gflops;
    res.extra_bytes = peak_ok && peak >= 0 && rss_before >= 0
                          ? std::max<std::int64_t>(0, peak - rss_before) * 1024
                          : -1;
    res.max_rel_err = run.slice_error();
    res.variants = cfg.variants;
    results.push_back(res);
    print_result(out, res, cfg.json);
    out.flush();
  }
  return results;
}

}  // namespace tokenmix::bench
