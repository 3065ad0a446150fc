// tools/testkit/testkit.cpp — see testkit.hpp.
#include "testkit.hpp"

#include <algorithm>
#include <random>

namespace tokenmix::testkit {

reference::Align to_reference(CausalAlign align) {
  return align == CausalAlign::top_left ? reference::Align::top_left
                                        : reference::Align::bottom_right;
}

AttentionOptions AttentionCase::options(Isa isa, int threads) const {
  AttentionOptions o;
  o.scale = scale;
  o.causal = shape.causal;
  o.align = shape.align;
  o.isa = isa;
  o.threads = threads;
  return o;
}

reference::Options AttentionCase::reference_options() const {
  reference::Options r;
  r.scale = scale;
  r.causal = shape.causal;
  r.align = to_reference(shape.align);
  return r;
}

reference::Tensor64 slice64(std::span<const float> x, std::int64_t B, std::int64_t T,
                            std::int64_t H, std::int64_t D, std::int64_t t0, std::int64_t nt,
                            std::int64_t h0, std::int64_t nh) {
  if (nt < 0) nt = T - t0;
  if (nh < 0) nh = H - h0;
  reference::Tensor64 r({B, nt, nh, D});
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < nt; ++t)
      for (std::int64_t h = 0; h < nh; ++h)
        for (std::int64_t d = 0; d < D; ++d)
          r.at(b, t, h, d) = x[static_cast<std::size_t>(((b * T + t0 + t) * H + h0 + h) * D + d)];
  return r;
}

std::vector<double> central_differences(std::vector<double>& x, const std::function<double()>& loss,
                                        double h) {
  std::vector<double> g(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) {
    const double keep = x[i];
    x[i] = keep + h;
    const double up = loss();
    x[i] = keep - h;
    const double down = loss();
    x[i] = keep;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

reference::Tensor64 central_differences(reference::Tensor64& x, const std::function<double()>& loss,
                                        double h) {
  reference::Tensor64 g(x.shape);
  g.data = central_differences(x.data, loss, h);
  return g;
}

double attention_loss(const reference::Tensor64& q, const reference::Tensor64& k,
                      const reference::Tensor64& v, const reference::Tensor64& dout,
                      const reference::Options& options) {
  const auto f = reference::attention_forward(q, k, v, options);
  double s = 0.0;
  for (std::size_t i = 0; i < f.out.data.size(); ++i) s += dout.data[i] * f.out.data[i];
  return s;
}

std::vector<float> random_normal(std::size_t n, std::uint64_t seed, double sigma) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, sigma);
  std::vector<float> out(n);
  for (auto& x : out) x = static_cast<float>(dist(rng));
  return out;
}

void apply_real_keys(std::vector<float>& k, std::int64_t T, std::int64_t H, std::int64_t D,
                     std::uint64_t seed) {
  if (T < 0 || H < 1 || D < 1 ||
      (T > 0 && static_cast<std::uint64_t>(H) * D > k.size() / static_cast<std::uint64_t>(T))) {
    throw ArgumentError(ErrorCode::invalid_argument,
                        "apply_real_keys: k must hold T * H * D values with T >= 0, H, D >= 1; "
                        "got k.size() = " +
                            std::to_string(k.size()) + ", T = " + std::to_string(T) +
                            ", H = " + std::to_string(H) + ", D = " + std::to_string(D));
  }
  const std::vector<float> offset =
      random_normal(static_cast<std::size_t>(H * D), seed, kRealKeyOffsetSigma);
  std::vector<double> s(static_cast<std::size_t>(H * D), 1.0);
  constexpr std::int64_t kOutliers = std::size(kRealKeyOutliers);
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t i = 0; i < kOutliers; ++i)
      s[static_cast<std::size_t>(h * D + (5 + i * (D / kOutliers) + h) % D)] = kRealKeyOutliers[i];
  for (std::int64_t t = 0; t < T; ++t) {
    const double m = t % kRealKeyMassiveEvery == 0 || t == 1 ? kRealKeyMassive : 1.0;
    for (std::int64_t c = 0; c < H * D; ++c) {
      float& x = k[static_cast<std::size_t>(t * H * D + c)];
      x = static_cast<float>(m * s[static_cast<std::size_t>(c)] *
                             (x + offset[static_cast<std::size_t>(c)]));
    }
  }
}

const std::vector<Isa>& concrete_isas() {
  static const std::vector<Isa> isas = {Isa::portable, Isa::avx2, Isa::avx512, Isa::neon,
                                        Isa::avx512_bf16};
  return isas;
}

std::string isa_unavailable_reason(Isa isa) {
  const std::vector<Isa> avail = available_isas();
  if (std::find(avail.begin(), avail.end(), isa) != avail.end()) return {};
  const CpuFeatures& f = cpu_features();
  const bool cpu_has = isa == Isa::portable || (isa == Isa::avx2 && f.avx2_fma) ||
                       (isa == Isa::avx512 && f.avx512f) || (isa == Isa::neon && f.neon) ||
                       (isa == Isa::avx512_bf16 && f.avx512_bf16);
  if (!cpu_has) {
    return std::string("this CPU/OS does not support ") + to_string(isa) + " (CPU: " + f.model +
           ")";
  }
  return std::string("this build has no ") + to_string(isa) + " kernels, although the CPU (" +
         f.model + ") supports them";
}

}  // namespace tokenmix::testkit
