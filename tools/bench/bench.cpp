// tools/bench/bench.cpp — see bench.hpp.
#include "bench.hpp"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <optional>
#include <random>
#include <sstream>

#include "api/huge_pages.hpp"
#include "kernels/kv_element.hpp"
#include "reference/reference.hpp"
#include "tokenmix/error.hpp"
#include "tokenmix/kv_cache.hpp"
#include "tokenmix/runtime.hpp"

namespace tokenmix::bench {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
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

void fill(std::vector<float>& x, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (float& e : x) e = dist(rng);
}

using reference::Tensor64;

// Copies rows [t0, t0 + rows) of heads [h0, h0 + heads) of a contiguous [B,T,H,D] tensor (batch 0).
Tensor64 slice64(const std::vector<float>& x, std::int64_t T, std::int64_t H, std::int64_t D,
                 std::int64_t t0, std::int64_t rows, std::int64_t h0, std::int64_t heads) {
  Tensor64 r({1, rows, heads, D});
  for (std::int64_t t = 0; t < rows; ++t)
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t d = 0; d < D; ++d) r.at(0, t, h, d) = x[((t0 + t) * H + h0 + h) * D + d];
  (void)T;
  return r;
}

// max |x − r| and max |r| accumulated over a slice.
struct ErrAcc {
  double diff = 0.0, ref = 0.0;
  void add(double x, double r) {
    diff = std::max(diff, std::isnan(x) ? INFINITY : std::fabs(x - r));
    ref = std::max(ref, std::fabs(r));
  }
  double rel() const { return diff / std::max(ref, 1e-30); }
};

struct Case {
  std::int64_t tq, tk;
  int threads;
  Isa isa;
};

}  // namespace

double sgemm_ceiling_gflops(int threads, int repeats) {
  const int n = 2048;
  std::vector<float> a(static_cast<std::size_t>(n) * n), b(a.size()), c(a.size());
  fill(a, 1);
  fill(b, 2);
  openblas_set_num_threads(threads);
  double best = 0.0;
  for (int r = 0; r < repeats + 1; ++r) {  // first run is a warm-up
    const auto t0 = Clock::now();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
                0.0f, c.data(), n);
    const double s = seconds_since(t0);
    if (r > 0) best = std::max(best, 2.0 * n * n * n / s * 1e-9);
  }
  openblas_set_num_threads(default_threads());
  return best;
}

StreamRead::StreamRead(std::size_t bytes) : buf_(bytes / sizeof(float) / 4096 * 4096) {
  const std::size_t n = buf_.size();
  // Same page treatment as the KV cache, so the ceiling is not handicapped.
  detail::back_with_huge_pages(buf_.data(), n * sizeof(float));
  float* buf = buf_.data();
#pragma omp parallel for schedule(static)
  for (std::size_t i = 0; i < n; ++i) buf[i] = static_cast<float>(i & 7);
}

double StreamRead::pass_gbps(int threads) {
  const std::size_t blocks = buf_.size() / 4096;
  const float* buf = buf_.data();
  const auto t0 = Clock::now();
  double total = 0.0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : total)
  for (std::size_t blk = 0; blk < blocks; ++blk) {  // 16 KiB per iteration, 16 independent sums
    float acc[16] = {};
    const float* p = buf + blk * 4096;
    for (std::size_t i = 0; i < 4096; i += 16)
#pragma omp simd
      for (int j = 0; j < 16; ++j) acc[j] += p[i + j];
    for (float a : acc) total += a;
  }
  const double s = seconds_since(t0);
  sink_ += total;
  return static_cast<double>(buf_.size() * sizeof(float)) / s * 1e-9;
}

std::string to_json(const BenchResult& r) {
  std::ostringstream os;
  os << std::setprecision(6) << "{\"op\": \"" << r.op << "\", \"batch\": " << r.batch << ", \"tq\": " << r.tq
     << ", \"tk\": " << r.tk << ", \"hq\": " << r.hq << ", \"hkv\": " << r.hkv << ", \"dh\": " << r.dh
     << ", \"threads\": " << r.threads << ", \"isa\": \"" << r.isa << "\", \"causal\": "
     << (r.causal ? "true" : "false") << ", \"align\": \"" << r.align << "\", \"seconds\": " << r.seconds
     << ", \"gflops\": " << r.gflops << ", \"ceiling_gflops\": " << r.ceiling_gflops
     << ", \"ratio\": " << r.ratio << ", \"max_rel_err\": " << r.max_rel_err
     << ", \"extra_bytes\": " << r.extra_bytes;
  if (r.op == "decode") {
    os << ", \"cache_dtype\": \"" << r.cache_dtype << "\", \"gbps\": " << r.gbps << ", \"ceiling_gbps\": " << r.ceiling_gbps;
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
  char line[256];
  const double extra_mib = r.extra_bytes < 0 ? -1.0 : r.extra_bytes / 1048576.0;
  if (r.op == "decode") {
    std::snprintf(line, sizeof line, "  %-8s %5lld %6lld %4lld %4lld %3lld %3d %-7s %-5s %8.2f %8.1f %8.1f %6.3f %12.2e %10.1f\n",
                  "decode", static_cast<long long>(r.tq), static_cast<long long>(r.tk), static_cast<long long>(r.hq),
                  static_cast<long long>(r.hkv), static_cast<long long>(r.dh), r.threads, r.isa.c_str(),
                  r.cache_dtype.c_str(), r.seconds * 1e3, r.gbps, r.ceiling_gbps, r.ratio, r.max_rel_err, extra_mib);
  } else {
    std::snprintf(line, sizeof line, "  %-8s %6lld %6lld %4lld %4lld %3lld %3d %-7s %9.2f %9.1f %6.1f %6.3f %12.2e %10.1f\n",
                  r.op.c_str(), static_cast<long long>(r.tq), static_cast<long long>(r.tk), static_cast<long long>(r.hq),
                  static_cast<long long>(r.hkv), static_cast<long long>(r.dh), r.threads, r.isa.c_str(), r.seconds * 1e3,
                  r.gflops, r.ceiling_gflops, r.ratio, r.max_rel_err, extra_mib);
  }
  out << line;
}
}  // namespace

namespace {

// `tokenmix bench decode`: one attention_decode step (T_new queries per sequence) against a
// contiguous KVCache holding T_k positions per sequence, for each (T_k, cache dtype, threads,
// isa). Reports K/V bytes read per second next to the streaming read bandwidth measured in the
// same run, and the max relative error of the group of KV head 0 (sequence 0) vs float64.
std::vector<BenchResult> run_decode(const BenchConfig& cfg, std::ostream& out) {
  if (cfg.tnew < 1) throw ArgumentError(ErrorCode::invalid_argument, "bench: --tnew must be >= 1");
  if (cfg.hq % cfg.hkv != 0) throw ArgumentError(ErrorCode::invalid_argument, "bench: --hkv must divide --hq");
  struct DecodeCase {
    std::int64_t tk;
    DType dtype;
    int threads;
    Isa isa;
  };
  std::vector<DecodeCase> cases;
  for (std::int64_t tk : cfg.cache_tokens)
    for (DType dt : cfg.cache_dtypes)
      for (int th : cfg.threads)
        for (Isa isa : cfg.isas) {
          if (tk < 1) throw ArgumentError(ErrorCode::invalid_argument, "bench: --tk must be >= 1");
          if (th < 0) throw ArgumentError(ErrorCode::invalid_argument, "bench: --threads must be >= 0");
          cases.push_back({tk, dt, th == 0 ? default_threads() : th, resolve_isa(isa)});
        }
  if (!cfg.json) {
    out << "tokenmix bench decode on " << cpu_features().model << "\n";
    out << "  op       T_new    T_k  H_q H_kv d_h thr isa     cache     ms     GB/s  ceiling  ratio  max_rel_err  extra_MiB\n";
  }
  const std::int64_t B = cfg.batch, Hq = cfg.hq, Hkv = cfg.hkv, D = cfg.dh, Tn = cfg.tnew,
                     g = Hq / Hkv;
  std::vector<BenchResult> results;
  std::optional<StreamRead> stream;     // 1 GiB, allocated once
  constexpr std::int64_t kFill = 4096;  // positions appended per call while filling the cache
  std::vector<float> kv_k(static_cast<std::size_t>(B * kFill * Hkv * D)), kv_v(kv_k.size());
  fill(kv_k, 21);
  fill(kv_v, 22);
  std::vector<float> q(static_cast<std::size_t>(B * Tn * Hq * D)), o(q.size()), lse(static_cast<std::size_t>(B * Hq * Tn));
  fill(q, 23);
  for (const DecodeCase& c : cases) {
    if (!stream) {
      if (cfg.progress)
        std::cerr << "[bench] allocating the 1 GiB streaming-read buffer (the ceiling)\n";
      stream.emplace();
    }
    if (cfg.progress) {
      std::cerr << "[bench] decode T_k=" << c.tk << " cache=" << to_string(c.dtype) << " threads=" << c.threads
                << " isa=" << to_string(c.isa) << "\n";
    }
    KVCache cache({1, B, Hkv, D, c.tk, c.dtype, 0, 0});
    for (std::int64_t t0 = 0; t0 < c.tk; t0 += kFill) {  // the 4096-position pattern repeats
      const std::int64_t n = std::min(kFill, c.tk - t0);
      const std::array<std::int64_t, 4> st{kFill * Hkv * D, Hkv * D, D, 1};
      cache.append(0, 0, ConstTensorView{kv_k.data(), DType::f32, 4, {B, n, Hkv, D}, st},
                   ConstTensorView{kv_v.data(), DType::f32, 4, {B, n, Hkv, D}, st});
    }
    DecodeOptions opt;
    opt.threads = c.threads;
    opt.isa = c.isa;
    const auto Q = ConstTensorView::bthd(q.data(), B, Tn, Hq, D);
    const auto O = TensorView::bthd(o.data(), B, Tn, Hq, D);
    const auto L = TensorView::bht(lse.data(), B, Hq, Tn);
    attention_decode(Q, cache, 0, O, L, opt);  // warm-up
    (void)stream->pass_gbps(c.threads);
    const std::int64_t rss_before = status_kib("VmRSS:");
    const bool peak_ok = reset_peak_rss();
    std::vector<double> times, ceiling;
    for (int r = 0; r < cfg.repeats; ++r) {  // a ceiling pass, then a step: same conditions
      ceiling.push_back(stream->pass_gbps(c.threads));
      const auto t0 = Clock::now();
      attention_decode(Q, cache, 0, O, L, opt);
      times.push_back(seconds_since(t0));
    }
    const std::int64_t peak = status_kib("VmHWM:");
    BenchResult res{};
    res.op = "decode";
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
    res.gflops = 4.0 * D * Hq * static_cast<double>(c.tk) * Tn * B / res.seconds * 1e-9;
    res.ceiling_gflops = 0.0;
    res.cache_dtype = to_string(c.dtype);
    res.gbps = static_cast<double>(decode_bytes(cache, 0, 0, B)) / res.seconds * 1e-9;
    res.ceiling_gbps = median(ceiling);
    res.ratio = res.gbps / res.ceiling_gbps;
    res.extra_bytes = peak_ok && peak >= 0 && rss_before >= 0 ? std::max<std::int64_t>(0, peak - rss_before) * 1024 : -1;

    // Error: sequence 0, the g query heads of KV head 0, against the float64 oracle on the
    // values as stored (fp32 rounded to the cache dtype).
    Tensor64 q64({1, Tn, g, D}), k64({1, c.tk, 1, D}), v64({1, c.tk, 1, D});
    for (std::int64_t t = 0; t < Tn; ++t)
      for (std::int64_t h = 0; h < g; ++h)
        for (std::int64_t x = 0; x < D; ++x) q64.at(0, t, h, x) = q[static_cast<std::size_t>((t * Hq + h) * D + x)];
    auto rounded = [&](float x) {  // as the cache stores it (round to nearest even), widened
      std::uint32_t slot = 0;
      kernels::store_element(c.dtype, &slot, 0, x);
      return static_cast<double>(kernels::load_element(c.dtype, &slot, 0));
    };
    for (std::int64_t t = 0; t < c.tk; ++t)
      for (std::int64_t x = 0; x < D; ++x) {
        const std::size_t src = static_cast<std::size_t>(((t % kFill) * Hkv) * D + x);
        k64.at(0, t, 0, x) = rounded(kv_k[src]);
        v64.at(0, t, 0, x) = rounded(kv_v[src]);
      }
    const auto ref = reference::attention_forward(q64, k64, v64);
    ErrAcc err;
    for (std::int64_t t = 0; t < Tn; ++t)
      for (std::int64_t h = 0; h < g; ++h)
        for (std::int64_t x = 0; x < D; ++x) err.add(o[static_cast<std::size_t>((t * Hq + h) * D + x)], ref.out.at(0, t, h, x));
    res.max_rel_err = err.rel();
    results.push_back(res);
    print_result(out, res, cfg.json);
    out.flush();
  }
  return results;
}

}  // namespace

std::vector<BenchResult> run(const BenchConfig& cfg, std::ostream& out) {
  if (cfg.op != "forward" && cfg.op != "backward" && cfg.op != "decode") {
    throw ArgumentError(ErrorCode::invalid_argument, "bench: op must be forward, backward or decode; got '" + cfg.op + "'");
  }
  for (auto [name, v] : {std::pair{"--batch", cfg.batch}, std::pair{"--hq", cfg.hq}, std::pair{"--hkv", cfg.hkv},
                         std::pair{"--dh", cfg.dh}, std::pair{"--tk", cfg.tk + 1}}) {
    if (v < 1) throw ArgumentError(ErrorCode::invalid_argument, std::string("bench: ") + name + " must be >= 1");
  }
  if (cfg.repeats < 1) throw ArgumentError(ErrorCode::invalid_argument, "bench: --repeats must be >= 1");
  if (cfg.op == "decode") return run_decode(cfg, out);
  const bool backward = cfg.op == "backward";
  std::vector<Case> cases;
  for (std::int64_t tq : cfg.tq)
    for (int th : cfg.threads)
      for (Isa isa : cfg.isas) {
        if (tq < 1) throw ArgumentError(ErrorCode::invalid_argument, "bench: --tq must be >= 1");
        if (th < 0) throw ArgumentError(ErrorCode::invalid_argument, "bench: --threads must be >= 0");
        cases.push_back({tq, cfg.tk > 0 ? cfg.tk : tq, th == 0 ? default_threads() : th, resolve_isa(isa)});
      }

  if (!cfg.json) {
    out << "tokenmix bench " << cfg.op << " on " << cpu_features().model << "\n";
    out << "  op        T_q    T_k  H_q H_kv d_h thr isa          ms   GFLOP/s  sgemm  ratio  max_rel_err  extra_MiB\n";
  }
  std::map<int, double> ceilings;
  std::vector<BenchResult> results;
  const std::int64_t B = cfg.batch, Hq = cfg.hq, Hkv = cfg.hkv, D = cfg.dh;
  for (const Case& c : cases) {
    if (!ceilings.count(c.threads)) {
      if (cfg.progress) std::cerr << "[bench] measuring sgemm 2048^3 ceiling, " << c.threads << " thread(s)\n";
      ceilings[c.threads] = sgemm_ceiling_gflops(c.threads);
    }
    if (cfg.progress) {
      std::cerr << "[bench] " << cfg.op << " T_q=" << c.tq << " T_k=" << c.tk << " threads=" << c.threads
                << " isa=" << to_string(c.isa) << "\n";
    }
    std::vector<float> q(static_cast<std::size_t>(B * c.tq * Hq * D)), k(static_cast<std::size_t>(B * c.tk * Hkv * D)),
        v(k.size()), o(q.size()), lse(static_cast<std::size_t>(B * Hq * c.tq));
    fill(q, 11);
    fill(k, 12);
    fill(v, 13);
    std::vector<float> dout, dq, dk, dv;
    AttentionOptions opt;
    opt.causal = cfg.causal;
    opt.align = cfg.align;
    opt.threads = c.threads;
    opt.isa = c.isa;
    const auto Q = ConstTensorView::bthd(q.data(), B, c.tq, Hq, D);
    const auto K = ConstTensorView::bthd(k.data(), B, c.tk, Hkv, D);
    const auto V = ConstTensorView::bthd(v.data(), B, c.tk, Hkv, D);
    const auto O = TensorView::bthd(o.data(), B, c.tq, Hq, D);
    const auto L = TensorView::bht(lse.data(), B, Hq, c.tq);
    if (backward) {
      dout.resize(q.size());
      fill(dout, 14);
      dq.assign(q.size(), 0.0f);
      dk.assign(k.size(), 0.0f);
      dv.assign(k.size(), 0.0f);
    }
    // Peak extra memory: resident-set growth over every call of this case (for backward, the
    // forward that produces O and L too), measured from here, where all inputs and outputs are
    // allocated and touched, so only the kernels' own scratch counts.
    const std::int64_t rss_before = status_kib("VmRSS:");
    const bool peak_ok = reset_peak_rss();
    attention_forward(Q, K, V, O, L, opt);
    auto call = [&] {
      if (backward) {
        attention_backward(Q, K, V, O, L, ConstTensorView::bthd(dout.data(), B, c.tq, Hq, D),
                           TensorView::bthd(dq.data(), B, c.tq, Hq, D), TensorView::bthd(dk.data(), B, c.tk, Hkv, D),
                           TensorView::bthd(dv.data(), B, c.tk, Hkv, D), opt);
      } else {
        attention_forward(Q, K, V, O, L, opt);
      }
    };
    call();  // warm-up
    std::vector<double> times;
    for (int r = 0; r < cfg.repeats; ++r) {
      const auto t0 = Clock::now();
      call();
      times.push_back(seconds_since(t0));
    }
    const std::int64_t peak = status_kib("VmHWM:");
    BenchResult res{};
    res.op = cfg.op;
    res.batch = B;
    res.tq = c.tq;
    res.tk = c.tk;
    res.hq = Hq;
    res.hkv = Hkv;
    res.dh = D;
    res.threads = c.threads;
    res.isa = to_string(c.isa);
    res.causal = cfg.causal;
    res.align = cfg.align == CausalAlign::bottom_right ? "bottom-right" : "top-left";
    res.seconds = median(times);
    const double flops = forward_flops(B, c.tq, c.tk, Hq, D, cfg.causal, cfg.align) * (backward ? 2.5 : 1.0);
    res.gflops = flops / res.seconds * 1e-9;
    res.ceiling_gflops = ceilings[c.threads];
    res.ratio = res.gflops / res.ceiling_gflops;
    res.extra_bytes = peak_ok && peak >= 0 && rss_before >= 0 ? std::max<std::int64_t>(0, peak - rss_before) * 1024 : -1;

    // Error on a slice: batch 0, the g query heads of KV head 0, R query rows — the last R for
    // bottom-right alignment (they see the most keys), the first R for top-left — against
    // the float64 oracle. For causal bottom-right with T_q = T_k the last R keys are seen only
    // by those rows, so dK/dV of those keys are checked exactly too.
    const std::int64_t g = Hq / Hkv, R = std::min<std::int64_t>(c.tq, 32);
    const bool last_rows = cfg.align == CausalAlign::bottom_right;
    const std::int64_t t0 = last_rows ? c.tq - R : 0;
    reference::Options ro;
    ro.causal = cfg.causal;
    ro.align = last_rows ? reference::Align::bottom_right : reference::Align::top_left;
    const Tensor64 q64 = slice64(q, c.tq, Hq, D, t0, R, 0, g);
    const Tensor64 k64 = slice64(k, c.tk, Hkv, D, 0, c.tk, 0, 1);
    const Tensor64 v64 = slice64(v, c.tk, Hkv, D, 0, c.tk, 0, 1);
    ErrAcc err;
    if (!backward) {
      const auto ref = reference::attention_forward(q64, k64, v64, ro);
      for (std::int64_t t = 0; t < R; ++t)
        for (std::int64_t h = 0; h < g; ++h)
          for (std::int64_t d = 0; d < D; ++d) err.add(o[((t0 + t) * Hq + h) * D + d], ref.out.at(0, t, h, d));
    } else {
      const Tensor64 do64 = slice64(dout, c.tq, Hq, D, t0, R, 0, g);
      const auto ref = reference::attention_backward(q64, k64, v64, do64, ro);
      for (std::int64_t t = 0; t < R; ++t)
        for (std::int64_t h = 0; h < g; ++h)
          for (std::int64_t d = 0; d < D; ++d) err.add(dq[((t0 + t) * Hq + h) * D + d], ref.dq.at(0, t, h, d));
      if (cfg.causal && last_rows && c.tq == c.tk) {
        for (std::int64_t u = c.tk - R; u < c.tk; ++u)
          for (std::int64_t d = 0; d < D; ++d) {
            err.add(dk[(u * Hkv) * D + d], ref.dk.at(0, u, 0, d));
            err.add(dv[(u * Hkv) * D + d], ref.dv.at(0, u, 0, d));
          }
      }
    }
    res.max_rel_err = err.rel();
    results.push_back(res);
    print_result(out, res, cfg.json);
    out.flush();
  }
  return results;
}

}  // namespace tokenmix::bench
