// tools/cli/cmd_check.cpp — `tokenmix check`: built-in self-checks, one PASS/FAIL line each.
//
// Every check compares this build's float32 kernels with the float64 oracle (src/reference) or
// with an exact property, on every kernel path this CPU runs (or the one --isa names):
//   gradient      float64 central differences of the reference forward vs our backward (and
//                 vs the reference backward), small GQA cases
//   softmax       Jacobian (4.6–4.7): symmetric, J·1 = 0, PSD (vᵀJv = Var_a(v) ≥ 0),
//                 matrix-free J·g = explicit J·g, masked entries carry nothing
//   causality     perturbing position p leaves outputs (and L, dQ) at t < p bitwise unchanged
//   attention     forward and backward vs the reference on a few shapes (MHA/GQA/MQA,
//                 T_q ≠ T_k in both alignments, empty rows, no mask, custom scale, SDPA layout)
//   layer         CausalSelfAttention forward and every gradient vs reference::layer_*
// Exit status 0 if all pass, 1 otherwise. An exception inside a check is that check's FAIL.
#include <CLI/CLI.hpp>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common.hpp"

namespace tokenmix::cli {
namespace {

using reference::Tensor64;

// Bounds on max|x − r| / max|r| (float32 results vs float64). The attention cases carry theirs
// in the case table (testkit::Tolerance: 2e-5 forward, 2e-4 backward).
constexpr double kGradCheckBound = 2e-4;     // our float32 backward vs float64 differences
constexpr double kRefGradCheckBound = 1e-7;  // float64 reference backward vs differences
constexpr double kLayerBound = 2e-4;

struct Outcome {
  bool pass = true;
  std::string detail;
};

class Reporter {
 public:
  void run(const std::string& name, const std::function<Outcome()>& check) {
    Outcome r;
    try {
      r = check();
    } catch (const std::exception& e) {
      r = {false, std::string("threw: ") + e.what()};
    }
    std::printf("%s  %-34s %s\n", r.pass ? "PASS" : "FAIL", name.c_str(), r.detail.c_str());
    std::fflush(stdout);
    failures_ += r.pass ? 0 : 1;
    ++total_;
  }
  int failures() const { return failures_; }
  int total() const { return total_; }

 private:
  int failures_ = 0, total_ = 0;
};

std::string e2(double v) {
  return fmt(v, "%.1e");
}

/// "err 1.2e-07 <= 2.0e-05" and whether it passed (NaN fails).
bool within(double err, double bound, std::string& detail, const std::string& label) {
  const bool ok = err <= bound;
  if (!detail.empty()) detail += ", ";
  detail += label + " " + e2(err) + (ok ? " <= " : " > ") + e2(bound);
  return ok;
}

using testkit::Layout;
using testkit::StridedTensor;

using testkit::AttentionCase;

/// The memory layout of a case's tensors: [B, T, H, d_h], or [B, H, T, d_h] (SDPA).
Layout layout_of(const AttentionCase& c) {
  return c.sdpa_layout ? Layout::bhtd : Layout::bthd;
}
/// Queries (and dO, dQ) or keys (and V, dK, dV) of a case, poisoned.
StridedTensor q_like(const AttentionCase& c) {
  return StridedTensor(c.shape.B, c.shape.T_q, c.shape.H_q, c.shape.d_h, layout_of(c));
}
StridedTensor k_like(const AttentionCase& c) {
  return StridedTensor(c.shape.B, c.shape.T_k, c.shape.H_kv, c.shape.d_h, layout_of(c));
}

/// q, k, v and dout of one case, filled from `rng`.
struct Inputs {
  StridedTensor q, k, v, dout;
  Inputs(const AttentionCase& c, std::mt19937_64& rng)
      : q(q_like(c)), k(k_like(c)), v(k_like(c)), dout(q_like(c)) {
    q.fill_random(rng), k.fill_random(rng), v.fill_random(rng), dout.fill_random(rng);
  }
};

/// Our forward + backward of one case; returns out, lse, dq, dk, dv.
struct Ours {
  StridedTensor out, dq, dk, dv;
  std::vector<float> lse;
};
Ours run_ours(const AttentionCase& c, Isa isa, int threads, Inputs& in) {
  const AttentionOptions options = c.options(isa, threads);
  const testkit::AttentionShape& s = c.shape;
  Ours r{q_like(c), q_like(c), k_like(c), k_like(c), {}};
  r.lse.assign(static_cast<std::size_t>(s.B * s.H_q * s.T_q), std::nanf(""));
  const TensorView lse = TensorView::bht(r.lse.data(), s.B, s.H_q, s.T_q);
  attention_forward(in.q.view, in.k.view, in.v.view, r.out.view, lse, options);
  attention_backward(in.q.view, in.k.view, in.v.view, r.out.view, lse, in.dout.view, r.dq.view,
                     r.dk.view, r.dv.view, options);
  return r;
}

double lse_err(const std::vector<float>& lse, const Tensor64& ref) {
  std::vector<double> r(ref.data.begin(), ref.data.end());
  return rel_err(lse, r);
}

// --- gradient check -----------------------------------------------------------------------------

Outcome gradient_check(Isa isa, int threads) {
  Outcome out;
  const std::vector<AttentionCase> cases = {
      {"GQA", {2, 6, 6, 4, 2, 8}},
      {"T_q < T_k bottom-right, MQA", {1, 4, 7, 3, 1, 6}},
  };
  std::mt19937_64 rng(7);
  double worst = 0.0, worst_ref = 0.0;
  for (const AttentionCase& c : cases) {
    Inputs in(c, rng);
    Ours ours = run_ours(c, isa, threads, in);

    Tensor64 q64 = in.q.to64(), k64 = in.k.to64(), v64 = in.v.to64();
    const Tensor64 do64 = in.dout.to64();
    const reference::Options ro = c.reference_options();
    auto loss = [&] { return testkit::attention_loss(q64, k64, v64, do64, ro); };  // Σ dO ⊙ O
    const auto ref_bwd = reference::attention_backward(q64, k64, v64, do64, ro);
    const Tensor64 gq = testkit::central_differences(q64, loss),
                   gk = testkit::central_differences(k64, loss),
                   gv = testkit::central_differences(v64, loss);
    worst = std::max({worst, rel_err(ours.dq, gq), rel_err(ours.dk, gk), rel_err(ours.dv, gv)});
    auto ref_err = [](const Tensor64& a, const Tensor64& b) { return rel_err(a.data, b.data); };
    worst_ref = std::max(
        {worst_ref, ref_err(ref_bwd.dq, gq), ref_err(ref_bwd.dk, gk), ref_err(ref_bwd.dv, gv)});
  }
  out.pass = within(worst, kGradCheckBound, out.detail, "ours vs differences");
  out.pass =
      within(worst_ref, kRefGradCheckBound, out.detail, "reference vs differences") && out.pass;
  return out;
}

// --- softmax Jacobian
// -----------------------------------------------------------------------------

Outcome softmax_check() {
  Outcome out;
  const std::size_t n = 17, masked = 5;
  std::mt19937_64 rng(11);
  std::normal_distribution<float> dist(0.0f, 2.0f);
  std::vector<float> z(n), a(n), J(n * n);
  for (auto& x : z) x = dist(rng);
  z[masked] = -std::numeric_limits<float>::infinity();
  softmax_rows(z, a, 1, static_cast<std::int64_t>(n));
  softmax_jacobian(a, J);

  double asym = 0.0, row_sum = 0.0, masked_abs = 0.0;
  for (std::size_t i = 0; i < n; ++i) {
    double s = 0.0;
    for (std::size_t j = 0; j < n; ++j) {
      asym = std::max(asym, static_cast<double>(std::fabs(J[i * n + j] - J[j * n + i])));
      s += J[i * n + j];
      if (i == masked || j == masked)
        masked_abs = std::max(masked_abs, std::fabs(1.0 * J[i * n + j]));
    }
    row_sum = std::max(row_sum, std::fabs(s));
  }
  // PSD: vᵀJv = Var_a(v) ≥ 0 for random v; compare with the variance computed in double.
  double min_quad = std::numeric_limits<double>::infinity(), var_err = 0.0, jvp_err = 0.0;
  std::vector<float> g(n), jg(n);
  for (int trial = 0; trial < 200; ++trial) {
    for (auto& x : g) x = dist(rng);
    double quad = 0.0, mean = 0.0, mean_sq = 0.0;
    std::vector<double> explicit_jg(n, 0.0);
    for (std::size_t i = 0; i < n; ++i) {
      for (std::size_t j = 0; j < n; ++j)
        explicit_jg[i] += static_cast<double>(J[i * n + j]) * g[j];
      quad += g[i] * explicit_jg[i];
      mean += a[i] * static_cast<double>(g[i]);
    }
    for (std::size_t i = 0; i < n; ++i) mean_sq += a[i] * (g[i] - mean) * (g[i] - mean);
    min_quad = std::min(min_quad, quad);
    var_err = std::max(var_err, std::fabs(quad - mean_sq) / std::max(mean_sq, 1e-6));
    softmax_jacobian_vector_product(a, g, jg);
    jvp_err = std::max(jvp_err, rel_err(jg, explicit_jg));
  }
  // Fully masked row: zeros and −∞, never NaN.
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<float> zm(4, ninf), am(4, 1.0f);
  softmax_rows(zm, am, 1, 4);
  const bool empty_ok = am == std::vector<float>(4, 0.0f) && logsumexp(zm) == ninf;

  // Against the float64 oracle's explicit Jacobian.
  std::vector<double> a64(a.begin(), a.end());
  const double ref_err = rel_err(J, reference::softmax_jacobian(a64));

  out.pass = asym <= 1e-7;
  out.detail = "|J-J^T| " + e2(asym);
  out.pass = within(row_sum, 1e-6, out.detail, "|J1|") && out.pass;
  out.pass = (min_quad >= -1e-6) && out.pass;
  out.detail += ", min v^T J v " + e2(min_quad);
  out.pass = within(var_err, 1e-4, out.detail, "v^T J v vs Var_a(v)") && out.pass;
  out.pass = within(jvp_err, 1e-6, out.detail, "Jg matrix-free vs explicit") && out.pass;
  out.pass = within(ref_err, 1e-6, out.detail, "J vs reference") && out.pass;
  out.pass = (masked_abs == 0.0) && empty_ok && out.pass;
  if (masked_abs != 0.0) out.detail += ", masked entry has nonzero Jacobian";
  if (!empty_ok) out.detail += ", all -inf row is not zeros/-inf";
  return out;
}

// --- causality
// ------------------------------------------------------------------------------------

Outcome causality_check(Isa isa, int threads) {
  Outcome out;
  const std::int64_t B = 2, T = 70, Hq = 4, Hkv = 2, D = 64, p = 41;
  const AttentionCase c{"causality", {B, T, T, Hq, Hkv, D}};
  std::mt19937_64 rng(3);
  Inputs in(c, rng);
  StridedTensor &q = in.q, &k = in.k, &v = in.v, &dout = in.dout;
  Ours before = run_ours(c, isa, threads, in);
  // Perturb every input at position p (queries, keys, values and the incoming gradient).
  for (std::int64_t b = 0; b < B; ++b) {
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t d = 0; d < D; ++d) q.at(b, p, h, d) += 1.5f, dout.at(b, p, h, d) -= 2.0f;
    for (std::int64_t h = 0; h < Hkv; ++h)
      for (std::int64_t d = 0; d < D; ++d) k.at(b, p, h, d) *= -3.0f, v.at(b, p, h, d) += 4.0f;
  }
  Ours after = run_ours(c, isa, threads, in);

  auto rows_equal = [&](StridedTensor& x, StridedTensor& y, std::int64_t t0, std::int64_t t1) {
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t t = t0; t < t1; ++t)
        if (std::memcmp(&x.at(b, t, 0, 0), &y.at(b, t, 0, 0),
                        static_cast<std::size_t>(x.view.shape[2] * D) * sizeof(float)) != 0)
          return false;
    return true;
  };
  bool lse_same = true;
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < Hq; ++h)
      lse_same = lse_same && std::memcmp(&before.lse[static_cast<std::size_t>((b * Hq + h) * T)],
                                         &after.lse[static_cast<std::size_t>((b * Hq + h) * T)],
                                         static_cast<std::size_t>(p) * sizeof(float)) == 0;
  const bool out_same = rows_equal(before.out, after.out, 0, p);
  const bool dq_same = rows_equal(before.dq, after.dq, 0, p);
  // The check must be able to fail: the perturbation has to reach the output at t = p.
  const bool changed = !rows_equal(before.out, after.out, p, p + 1);
  out.pass = out_same && lse_same && dq_same && changed;
  out.detail = "perturbed t=" + std::to_string(p) + " of T=" + std::to_string(T) +
               ": O, L, dQ at t<" + std::to_string(p) +
               (out_same && lse_same && dq_same ? " bitwise unchanged" : " CHANGED");
  if (!changed) out.detail += ", but O at t=p did not change (perturbation ignored?)";
  return out;
}

// --- forward / backward vs reference
// --------------------------------------------------------------

Outcome attention_check(const AttentionCase& c, Isa isa, int threads) {
  const testkit::AttentionShape& s = c.shape;
  std::mt19937_64 rng(static_cast<std::uint64_t>(s.T_q * 131 + s.T_k * 7 + s.d_h));
  Inputs in(c, rng);
  Ours ours = run_ours(c, isa, threads, in);
  const reference::Options ro = c.reference_options();
  const Tensor64 q64 = in.q.to64(), k64 = in.k.to64(), v64 = in.v.to64(), do64 = in.dout.to64();
  const auto f = reference::attention_forward(q64, k64, v64, ro);
  const auto b = reference::attention_backward(q64, k64, v64, do64, ro);
  Outcome out;
  out.pass = within(rel_err(ours.out, f.out), c.tolerance.forward, out.detail, "O");
  out.pass = within(lse_err(ours.lse, f.lse), c.tolerance.forward, out.detail, "L") && out.pass;
  const double db =
      std::max({rel_err(ours.dq, b.dq), rel_err(ours.dk, b.dk), rel_err(ours.dv, b.dv)});
  out.pass = within(db, c.tolerance.backward, out.detail, "dQ,dK,dV") && out.pass;
  return out;
}

// --- layer vs reference
// ---------------------------------------------------------------------------

Outcome layer_check(std::optional<RopePairing> pairing, std::int64_t Hkv, Isa isa, int threads) {
  const std::int64_t d = 48, Hq = 4, D = 12, B = 2, T = 9;
  LayerConfig config;
  config.d_model = d;
  config.heads_q = Hq;
  config.heads_kv = Hkv;
  config.head_dim = D;
  if (pairing) config.rope = RopeOptions{*pairing, 10000.0, 0};
  config.attention.isa = isa;
  config.attention.threads = threads;
  CausalSelfAttention layer(config);
  layer.init_random(99);
  const std::vector<float> u = random_normal(static_cast<std::size_t>(B * T * d), 5);
  const std::vector<float> d_out = random_normal(static_cast<std::size_t>(B * T * d), 6);
  std::vector<float> o(u.size());
  layer.forward(u, B, T, o);
  LayerGradients grads;
  layer.backward(d_out, grads);

  reference::LayerWeights w;
  w.d_model = d, w.heads_q = Hq, w.heads_kv = Hkv, w.head_dim = D;
  w.use_rope = pairing.has_value();
  w.pairing = pairing == RopePairing::interleaved ? reference::RopePairing::interleaved
                                                  : reference::RopePairing::rotate_half;
  w.rope_base = 10000.0;
  auto to64 = [](std::span<const float> x) { return std::vector<double>(x.begin(), x.end()); };
  w.w_q = to64(layer.w_q()), w.w_k = to64(layer.w_k()), w.w_v = to64(layer.w_v()),
  w.w_o = to64(layer.w_o());
  const std::vector<double> u64 = to64(u), do64 = to64(d_out);
  const std::vector<double> ref_out = reference::layer_forward(w, u64, B, T);
  const reference::LayerGrads g = reference::layer_backward(w, u64, B, T, do64);

  Outcome out;
  out.pass = within(rel_err(o, ref_out), kLayerBound, out.detail, "O");
  const double eg = std::max({rel_err(grads.d_u, g.d_u), rel_err(grads.d_w_q, g.d_w_q),
                              rel_err(grads.d_w_k, g.d_w_k), rel_err(grads.d_w_v, g.d_w_v),
                              rel_err(grads.d_w_o, g.d_w_o)});
  out.pass = within(eg, kLayerBound, out.detail, "dU,dW_Q,dW_K,dW_V,dW_O") && out.pass;
  return out;
}

int run_check(const std::string& isa_name, int threads) {
  std::vector<Isa> isas;
  if (isa_name == "auto" || isa_name == "all") {
    isas = available_isas();
  } else {
    const Isa isa = parse_isa(isa_name, "--isa");
    isas = {resolve_isa(isa)};
  }
  apply_blas_threads(threads);
  Reporter report;
  report.run("softmax Jacobian (4.6-4.7)", [] { return softmax_check(); });

  // The attention case table: name, shape {B, T_q, T_k, H_q, H_kv, d_h, causal, align}, scale,
  // SDPA layout; every case has the default tolerance (2e-5 forward, 2e-4 backward).
  constexpr CausalAlign kTopLeft = CausalAlign::top_left;
  const std::vector<AttentionCase> cases = {
      {"1x1 head, T=1", {1, 1, 1, 1, 1, 8}},
      {"GQA g=2, T=37, d_h=64", {2, 37, 37, 4, 2, 64}},
      {"MQA g=8, T=130, d_h=128", {1, 130, 130, 8, 1, 128}},
      {"T_q=5 < T_k=19 bottom-right", {1, 5, 19, 2, 2, 32}},
      {"T_q=19 > T_k=5 bottom-right (empty rows)", {1, 19, 5, 2, 1, 16}},
      {"T_q=9, T_k=14 top-left", {1, 9, 14, 2, 1, 24, true, kTopLeft}},
      {"no mask, scale 0.3, d_h=80", {2, 33, 33, 2, 2, 80, false}, 0.3},
      {"SDPA layout [B,H,T,d_h], T=65", {1, 65, 65, 4, 2, 32}, {}, true},
  };

  for (Isa isa : isas) {
    const std::string tag = std::string(" [") + to_string(isa) + "]";
    report.run("gradient check" + tag, [&] { return gradient_check(isa, threads); });
    report.run("causality" + tag, [&] { return causality_check(isa, threads); });
    for (const AttentionCase& c : cases)
      report.run("attention " + c.name + tag, [&] { return attention_check(c, isa, threads); });
    report.run("layer GQA, RoPE rotate-half" + tag,
               [&] { return layer_check(RopePairing::rotate_half, 2, isa, threads); });
    report.run("layer MQA, RoPE interleaved" + tag,
               [&] { return layer_check(RopePairing::interleaved, 1, isa, threads); });
    report.run("layer MHA, no RoPE" + tag,
               [&] { return layer_check(std::nullopt, 4, isa, threads); });
  }
  std::printf("%d of %d checks passed\n", report.total() - report.failures(), report.total());
  return report.failures() == 0 ? kExitOk : kExitCheckFailed;
}

}  // namespace

Command add_check_command(CLI::App& parent) {
  CLI::App* sub = parent.add_subcommand(
      "check",
      "Run the built-in self-checks against the float64 reference, one PASS/FAIL line each, on "
      "every kernel path this CPU supports; exit 1 if any fails");
  struct Args {
    std::string isa = "auto";
    int threads = 0;
  };
  auto args = std::make_shared<Args>();
  sub->add_option(
         "--isa", args->isa,
         "Check only this kernel path (portable, avx2, avx512, avx512_bf16, neon); auto = every "
         "available")
      ->capture_default_str();
  sub->add_option("--threads", args->threads, "Threads (0 = all)")
      ->capture_default_str()
      ->check(CLI::Range(0, 4096));
  return {sub, [args] { return run_check(args->isa, args->threads); }};
}

}  // namespace tokenmix::cli
