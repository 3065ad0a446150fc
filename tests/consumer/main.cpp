// Downstream smoke test: runs tokenmix::attention_forward on a small random GQA case and compares
// O and the row log-sum-exp L with a naive double-precision computation written out here
// (SPEC 4.2–4.5, 4.8). Exit status 0 only if everything agrees.
//
//   q [B, T, H_q, d_h], k, v [B, T, H_kv, d_h]  (contiguous BTHD)
//   S = s · Q_h K_jᵀ, j = h / g;  A = softmax(S + M) (causal, T_q = T_k);  O_h = A V_j
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include <tokenmix/tokenmix.hpp>

namespace {

constexpr std::int64_t B = 2, T = 13, Hq = 6, Hkv = 2, D = 20;  // g = 3, odd T

std::int64_t at(std::int64_t b, std::int64_t t, std::int64_t h, std::int64_t H, std::int64_t d) {
  return ((b * T + t) * H + h) * D + d;
}

// |got − want|, with NaN counted as an infinite error (std::max would silently drop it).
double error(double want, float got) {
  const double e = std::abs(want - double(got));
  return std::isnan(e) ? std::numeric_limits<double>::infinity() : e;
}

}  // namespace

int main() {
  if (std::strcmp(tokenmix::version(), TOKENMIX_EXPECTED_VERSION) != 0) {
    std::printf("FAIL: library reports version %s, package says %s\n", tokenmix::version(),
                TOKENMIX_EXPECTED_VERSION);
    return 1;
  }

  std::mt19937 rng(1234);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> q(B * T * Hq * D), k(B * T * Hkv * D), v(B * T * Hkv * D);
  for (auto* x : {&q, &k, &v}) {
    for (float& e : *x) e = normal(rng);
  }
  std::vector<float> out(q.size(), std::numeric_limits<float>::quiet_NaN());
  std::vector<float> lse(B * Hq * T, std::numeric_limits<float>::quiet_NaN());

  try {
    tokenmix::attention_forward(tokenmix::ConstTensorView::bthd(q.data(), B, T, Hq, D),
                                tokenmix::ConstTensorView::bthd(k.data(), B, T, Hkv, D),
                                tokenmix::ConstTensorView::bthd(v.data(), B, T, Hkv, D),
                                tokenmix::TensorView::bthd(out.data(), B, T, Hq, D),
                                tokenmix::TensorView::bht(lse.data(), B, Hq, T));
  } catch (const tokenmix::Error& e) {
    std::printf("FAIL: attention_forward threw %s: %s\n", tokenmix::to_string(e.code()), e.what());
    return 1;
  }

  // Naive reference, one (b, h, t) row at a time.
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const std::int64_t g = Hq / Hkv;
  double max_err_o = 0.0, max_err_l = 0.0;
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < Hq; ++h) {
      const std::int64_t j = h / g;
      for (std::int64_t t = 0; t < T; ++t) {
        std::vector<double> s(t + 1);  // causal: keys u <= t
        double m = -std::numeric_limits<double>::infinity();
        for (std::int64_t u = 0; u <= t; ++u) {
          double dot = 0.0;
          for (std::int64_t d = 0; d < D; ++d)
            dot += double(q[at(b, t, h, Hq, d)]) * k[at(b, u, j, Hkv, d)];
          s[u] = dot * scale;
          m = std::max(m, s[u]);
        }
        double sum = 0.0;
        for (double& e : s) sum += (e = std::exp(e - m));
        const double l = m + std::log(sum);
        max_err_l = std::max(max_err_l, error(l, lse[(b * Hq + h) * T + t]));
        for (std::int64_t d = 0; d < D; ++d) {
          double o = 0.0;
          for (std::int64_t u = 0; u <= t; ++u) o += s[u] / sum * v[at(b, u, j, Hkv, d)];
          max_err_o = std::max(max_err_o, error(o, out[at(b, t, h, Hq, d)]));
        }
      }
    }
  }

  const bool ok = max_err_o < 1e-4 && max_err_l < 1e-4;
  std::printf(
      "%s: tokenmix %s, B=%d T=%d H_q=%d H_kv=%d d_h=%d: max |dO| = %.3g, max |dL| = %.3g\n",
      ok ? "OK" : "FAIL", tokenmix::version(), int(B), int(T), int(Hq), int(Hkv), int(D), max_err_o,
      max_err_l);
  return ok ? 0 : 1;
}
