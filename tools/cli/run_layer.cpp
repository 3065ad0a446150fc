// tools/cli/run_layer.cpp — `tokenmix run` without files: one Llama-3-8B-shaped attention layer.
//
// Layer (SPEC 4.1–4.5, 4.8): d = 4096, H_q = 32, H_kv = 8 (g = 4, GQA), d_h = 128, RoPE
// rotate-half with base 500000; seeded random weights (CausalSelfAttention::init_random), input
// U ~ N(0, 1) [B, T, d] and upstream gradient dO ~ N(0, 1) [B, T, d].
//
// Phases: forward, backward, check, decode. The decode phase prefills the T tokens into a KV
// cache (KVCache, bf16 by default) and generates --decode-steps more one at a time
// (CausalSelfAttention::step), then checks the generated outputs against one forward over all
// T + steps tokens: the cache must give the same attention (SPEC 4.3 bottom-right, 4.8).
//
// The check: The check recomputes slices in float64 with the oracle
// (src/reference) from the tensors the forward saved (CausalSelfAttention::saved()), so it
// measures this run's kernels and GEMMs, not a second float32 computation:
//   - attention Y and L of all heads on three windows of query rows (start, middle, end): with
//     bottom-right alignment, queries [t0, t0+W) against keys [0, t0+W) are exactly that slice;
//   - Q, K, V projections with RoPE and the output projection O = Y W_O at 4 positions;
//   - backward of all heads for the last rows: queries [T−4, T) against all keys form a complete
//     sub-problem for dQ of those rows and dK, dV of key rows ≥ T−4 (no earlier query sees them),
//     hence for whole rows of dU (dY = dO W_Oᵀ, inverse RoPE and the projections included);
//   - 8 rows of dW_O = Yᵀ dO over all positions;
//   - for T ≤ 256 only, the oracle's full-length backward of KV group 0 (query heads 0..g−1)
//     and 8 rows of dW_Q, dW_K, dW_V from it. The oracle forms every row's softmax Jacobian
//     (O(T³) per head, ~4 s per head at T = 1024), too slow for the default run; `tokenmix
//     check` compares every gradient of smaller layers in full.
// Error metric everywhere: max|x − r| / max|r| over the compared entries.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <string>
#include <vector>

#include "common.hpp"
#include "run.hpp"

namespace tokenmix::cli {
namespace {

using reference::Tensor64;

constexpr std::int64_t kModel = 4096, kHeadsQ = 32, kHeadsKv = 8, kHeadDim = 128;
constexpr double kRopeBase = 500000.0;
/// Bound on every relative error of the check. float32 rounding is 6e-8; the longest sums here
/// (K = 4096 in the projections, T·B in the weight gradients) stay well below 1e-5 in practice.
constexpr double kErrorBound = 1e-4;
/// Longest sequence for which the check runs the oracle's full-length backward (see below).
constexpr std::int64_t kFullCheckMaxT = 256;
/// Bound for decode-vs-forward with a bf16/f16 cache: K and V are rounded to 8 (bf16) or 11
/// (f16) significant bits on write, a relative error of at most 2^-9 per element that enters
/// both the scores and the values; 2·2^-9 ≈ 4e-3 (tests/unit/test_kv_cache.cpp uses the same).
/// With an fp32 cache the bound is kErrorBound.
constexpr double kDecodeBoundLowPrecision = 4e-3;

struct CheckRow {
  std::string what;
  double error = 0.0;
  bool skipped = false;
};

/// Copies heads [h0, h0 + n) of a contiguous [B, T, H, D] float tensor into a Tensor64.
Tensor64 heads_slice(const std::vector<float>& x, std::int64_t B, std::int64_t T, std::int64_t H,
                     std::int64_t D, std::int64_t h0, std::int64_t n, std::int64_t t0 = 0,
                     std::int64_t nt = -1) {
  if (nt < 0) nt = T - t0;
  Tensor64 r({B, nt, n, D});
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < nt; ++t)
      for (std::int64_t h = 0; h < n; ++h)
        for (std::int64_t d = 0; d < D; ++d)
          r.at(b, t, h, d) = x[static_cast<std::size_t>(((b * T + t0 + t) * H + h0 + h) * D + d)];
  return r;
}

/// row[n] = Σ_i x[i] W[i, n] in double; W is [rows, cols] row-major float.
std::vector<double> row_times(const float* x, std::span<const float> w, std::int64_t rows,
                              std::int64_t cols) {
  std::vector<double> out(static_cast<std::size_t>(cols), 0.0);
  for (std::int64_t i = 0; i < rows; ++i) {
    const double xi = x[i];
    const float* wr = w.data() + i * cols;
    for (std::int64_t n = 0; n < cols; ++n) out[static_cast<std::size_t>(n)] += xi * wr[n];
  }
  return out;
}

/// RoPE (reference, double) of one row [H, D] at absolute position p; inverse for gradients.
std::vector<double> rope_row(const std::vector<double>& row, std::int64_t H, std::int64_t p,
                             bool inverse) {
  Tensor64 t({1, 1, H, kHeadDim});
  t.data = row;
  return reference::rope(t, reference::RopePairing::rotate_half, kRopeBase, p, inverse).data;
}

std::string window_list(const std::vector<std::int64_t>& starts, std::int64_t w) {
  std::string s;
  for (std::int64_t t0 : starts)
    s += (s.empty() ? "" : ", ") + std::to_string(t0) + "-" + std::to_string(t0 + w - 1);
  return s;
}

std::vector<std::int64_t> spread(std::int64_t n, std::int64_t count) {
  std::vector<std::int64_t> out;
  for (std::int64_t i = 0; i < count; ++i) {
    const std::int64_t v = count == 1 ? n - 1 : i * (n - 1) / (count - 1);
    if (out.empty() || out.back() != v) out.push_back(v);
  }
  return out;
}

/// Rows [t0, t0 + n) of all heads as a Tensor64 [B, n, H, D].
Tensor64 rows_of(const std::vector<float>& x, std::int64_t B, std::int64_t T, std::int64_t H,
                 std::int64_t t0, std::int64_t n) {
  return heads_slice(x, B, T, H, kHeadDim, 0, H, t0, n);
}

std::vector<CheckRow> check_layer(const CausalSelfAttention& layer, std::span<const float> out,
                                  std::span<const float> d_out, const LayerGradients& grads) {
  const auto& s = layer.saved();
  const std::int64_t B = s.batch, T = s.seq, d = kModel, Hq = kHeadsQ, Hkv = kHeadsKv, D = kHeadDim,
                     g = Hq / Hkv;
  const std::int64_t nq = Hq * D, nkv = Hkv * D;
  std::vector<CheckRow> rows;
  auto idx = [](std::int64_t i) { return static_cast<std::size_t>(i); };
  auto at = [&](std::span<const float> x, std::int64_t i) {
    return static_cast<double>(x[idx(i)]);
  };

  // --- forward: attention of all heads on three windows of query rows ---------------------------
  // With bottom-right alignment, queries [t0, t0 + W) against keys [0, t0 + W) (T_q = W,
  // T_k = t0 + W) is exactly the slice of the full causal problem: query i sits at t0 + i.
  const std::int64_t W = std::min<std::int64_t>(8, T);
  std::vector<std::int64_t> starts = {0, (T - W) / 2, T - W};
  starts.erase(std::unique(starts.begin(), starts.end()), starts.end());
  progress("check: attention of all heads on query rows " + window_list(starts, W) +
           " vs float64 reference");
  {
    ErrorAccumulator ey, el;
    for (std::int64_t t0 : starts) {
      const Tensor64 q = rows_of(s.q, B, T, Hq, t0, W);
      const Tensor64 k = rows_of(s.k, B, T, Hkv, 0, t0 + W);
      const Tensor64 v = rows_of(s.v, B, T, Hkv, 0, t0 + W);
      const reference::ForwardResult f = reference::attention_forward(q, k, v);
      for (std::int64_t b = 0; b < B; ++b)
        for (std::int64_t i = 0; i < W; ++i)
          for (std::int64_t h = 0; h < Hq; ++h) {
            for (std::int64_t e = 0; e < D; ++e)
              ey.add(s.y[idx(((b * T + t0 + i) * Hq + h) * D + e)], f.out.at(b, i, h, e));
            el.add(s.lse[idx((b * Hq + h) * T + t0 + i)], f.lse.at(b, h, i, 0));
          }
    }
    rows.push_back({"attention Y, all heads, rows " + window_list(starts, W), ey.value()});
    rows.push_back({"log-sum-exp L, same rows", el.value()});
  }

  // --- forward: projections at a few positions
  // ----------------------------------------------------
  progress("check: projections and RoPE at a few positions");
  const std::vector<std::int64_t> ts = spread(T, 4);
  {
    ErrorAccumulator eq, ek, ev, eo;
    for (std::int64_t b : {std::int64_t{0}, B - 1}) {
      for (std::int64_t t : ts) {
        const float* u = s.u.data() + (b * T + t) * d;
        const auto q = rope_row(row_times(u, layer.w_q(), d, nq), Hq, t, false);
        const auto k = rope_row(row_times(u, layer.w_k(), d, nkv), Hkv, t, false);
        const auto v = row_times(u, layer.w_v(), d, nkv);
        for (std::int64_t n = 0; n < nq; ++n) eq.add(s.q[idx((b * T + t) * nq + n)], q[idx(n)]);
        for (std::int64_t n = 0; n < nkv; ++n) {
          ek.add(s.k[idx((b * T + t) * nkv + n)], k[idx(n)]);
          ev.add(s.v[idx((b * T + t) * nkv + n)], v[idx(n)]);
        }
        const auto o = row_times(s.y.data() + (b * T + t) * nq, layer.w_o(), nq, d);
        for (std::int64_t n = 0; n < d; ++n) eo.add(at(out, (b * T + t) * d + n), o[idx(n)]);
      }
      if (B == 1) break;
    }
    const std::string where = ", " + std::to_string(ts.size()) + " position(s)";
    rows.push_back({"Q = RoPE(U W_Q)" + where, eq.value()});
    rows.push_back({"K = RoPE(U W_K)" + where, ek.value()});
    rows.push_back({"V = U W_V" + where, ev.value()});
    rows.push_back({"O = Y W_O" + where, eo.value()});
  }

  // --- backward: the last rows, all heads → dU rows ----------------------------------------------
  // Queries [T − Wb, T) against all keys form a complete sub-problem for dQ of those rows and for
  // dK, dV of key rows ≥ T − Wb (no earlier query sees them), hence for the whole rows of dU.
  const std::int64_t Wb = std::min<std::int64_t>(4, T), tb = T - Wb;
  progress("check: backward of all heads for rows t >= " + std::to_string(tb) + " (dU)");
  {
    const Tensor64 q = rows_of(s.q, B, T, Hq, tb, Wb);
    const Tensor64 k = rows_of(s.k, B, T, Hkv, 0, T);
    const Tensor64 v = rows_of(s.v, B, T, Hkv, 0, T);
    Tensor64 dy({B, Wb, Hq, D});  // dY = dO W_Oᵀ for those rows, in double
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < Wb; ++i)
        for (std::int64_t r = 0; r < nq; ++r) {
          const float* w = layer.w_o().data() + r * d;
          const float* g_row = d_out.data() + (b * T + tb + i) * d;
          double acc = 0.0;
          for (std::int64_t n = 0; n < d; ++n) acc += static_cast<double>(g_row[n]) * w[n];
          dy.data[idx((b * Wb + i) * nq + r)] = acc;
        }
    const reference::BackwardResult bw = reference::attention_backward(q, k, v, dy);
    // Inverse RoPE at absolute positions tb + i (dK: rows tb.. of the full-length result).
    const Tensor64 dq = reference::rope(bw.dq, reference::RopePairing::rotate_half, kRopeBase, tb,
                                        /*inverse=*/true);
    Tensor64 dk_rows({B, Wb, Hkv, D}), dv_rows({B, Wb, Hkv, D});
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < Wb; ++i)
        for (std::int64_t c = 0; c < nkv; ++c) {
          dk_rows.data[idx((b * Wb + i) * nkv + c)] = bw.dk.data[idx((b * T + tb + i) * nkv + c)];
          dv_rows.data[idx((b * Wb + i) * nkv + c)] = bw.dv.data[idx((b * T + tb + i) * nkv + c)];
        }
    const Tensor64 dk = reference::rope(dk_rows, reference::RopePairing::rotate_half, kRopeBase, tb,
                                        /*inverse=*/true);
    ErrorAccumulator eu;
    // dU[t, i] = Σ_c dQ[t, c] W_Q[i, c] + Σ_c dK[t, c] W_K[i, c] + Σ_c dV[t, c] W_V[i, c]
#pragma omp parallel for schedule(static)
    for (std::int64_t i = 0; i < d; ++i) {
      const float* wq = layer.w_q().data() + i * nq;
      const float* wk = layer.w_k().data() + i * nkv;
      const float* wv = layer.w_v().data() + i * nkv;
      for (std::int64_t bt = 0; bt < B * Wb; ++bt) {
        double acc = 0.0;
        for (std::int64_t c = 0; c < nq; ++c) acc += dq.data[idx(bt * nq + c)] * wq[c];
        for (std::int64_t c = 0; c < nkv; ++c)
          acc += dk.data[idx(bt * nkv + c)] * wk[c] + dv_rows.data[idx(bt * nkv + c)] * wv[c];
        const std::int64_t b = bt / Wb, t = tb + bt % Wb;
        const double x = grads.d_u[idx((b * T + t) * d + i)];
#pragma omp critical
        eu.add(x, acc);
      }
    }
    rows.push_back({"dU, all heads, rows t >= " + std::to_string(tb), eu.value()});
  }

  // --- backward: dW_O = Yᵀ dO, a few rows over all positions
  // --------------------------------------
  {
    ErrorAccumulator ewo;
    for (std::int64_t r : spread(nq, 8)) {
      std::vector<double> acc(idx(d), 0.0);
      for (std::int64_t bt = 0; bt < B * T; ++bt) {
        const double y = s.y[idx(bt * nq + r)];
        const float* g_row = d_out.data() + bt * d;
        for (std::int64_t n = 0; n < d; ++n) acc[idx(n)] += y * g_row[n];
      }
      for (std::int64_t n = 0; n < d; ++n) ewo.add(grads.d_w_o[idx(r * d + n)], acc[idx(n)]);
    }
    rows.push_back({"dW_O = Y^T dO, 8 rows", ewo.value()});
  }

  // --- backward: KV group 0 over all positions → rows of dW_Q, dW_K, dW_V
  // --------------------------- Needs dQ, dK, dV of every position, i.e. the oracle's full
  // backward, which materialises the Jacobian of every row (O(T³) per head): only for short
  // sequences.
  if (T > kFullCheckMaxT) {
    rows.push_back(
        {"dW_Q, dW_K, dW_V (only for T <= " + std::to_string(kFullCheckMaxT) + ")", 0.0, true});
    return rows;
  }
  progress("check: backward of KV group 0 over all positions (dW_Q, dW_K, dW_V)");
  {
    const std::int64_t gd = g * D;
    const Tensor64 qg = heads_slice(s.q, B, T, Hq, D, 0, g);
    const Tensor64 kg = heads_slice(s.k, B, T, Hkv, D, 0, 1);
    const Tensor64 vg = heads_slice(s.v, B, T, Hkv, D, 0, 1);
    Tensor64 dyg({B, T, g, D});  // dY_h = dO W_O[rows of head h]ᵀ, h < g
#pragma omp parallel for schedule(static)
    for (std::int64_t bt = 0; bt < B * T; ++bt)
      for (std::int64_t r = 0; r < gd; ++r) {
        const float* w = layer.w_o().data() + r * d;
        const float* g_row = d_out.data() + bt * d;
        double acc = 0.0;
        for (std::int64_t n = 0; n < d; ++n) acc += static_cast<double>(g_row[n]) * w[n];
        dyg.data[idx(bt * gd + r)] = acc;
      }
    reference::BackwardResult bg = reference::attention_backward(qg, kg, vg, dyg);
    bg.dq = reference::rope(bg.dq, reference::RopePairing::rotate_half, kRopeBase, 0, true);
    bg.dk = reference::rope(bg.dk, reference::RopePairing::rotate_half, kRopeBase, 0, true);
    ErrorAccumulator ewq, ewk, ewv;
    for (std::int64_t i : spread(d, 8)) {
      for (std::int64_t c = 0; c < gd; ++c) {  // dW_Q[i, c] = Σ_{b,t} U[b,t,i] dQ[b,t,c]
        double acc = 0.0;
        for (std::int64_t bt = 0; bt < B * T; ++bt)
          acc += static_cast<double>(s.u[idx(bt * d + i)]) * bg.dq.data[idx(bt * gd + c)];
        ewq.add(grads.d_w_q[idx(i * nq + c)], acc);
      }
      for (std::int64_t c = 0; c < D; ++c) {  // KV head 0 = columns 0..D-1 of dW_K, dW_V
        double acc_k = 0.0, acc_v = 0.0;
        for (std::int64_t bt = 0; bt < B * T; ++bt) {
          const double u = s.u[idx(bt * d + i)];
          acc_k += u * bg.dk.data[idx(bt * D + c)];
          acc_v += u * bg.dv.data[idx(bt * D + c)];
        }
        ewk.add(grads.d_w_k[idx(i * nkv + c)], acc_k);
        ewv.add(grads.d_w_v[idx(i * nkv + c)], acc_v);
      }
    }
    // One denominator for the three: dQ and dK vanish identically when T = 1 (a single visible
    // key makes dS = A ⊙ (dA − D) = 0), where a per-matrix ratio would divide rounding by zero.
    const double ref = std::max({ewq.max_ref, ewk.max_ref, ewv.max_ref});
    for (ErrorAccumulator* e : {&ewq, &ewk, &ewv}) e->max_ref = ref;
    rows.push_back(
        {"dW_Q, 8 rows x heads 0-" + std::to_string(g - 1) + ", all t (*)", ewq.value()});
    rows.push_back({"dW_K, 8 rows x KV head 0, all t (*)", ewk.value()});
    rows.push_back({"dW_V, 8 rows x KV head 0, all t (*)", ewv.value()});
  }
  return rows;
}

std::string human_bytes(std::uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  return u == 0 ? std::to_string(bytes) + " B" : fmt(v, "%.2f") + " " + units[u];
}

}  // namespace

int run_layer(const LayerRunOptions& o) {
  const std::int64_t B = o.batch, T = o.seq, d = kModel;
  LayerConfig config;
  config.d_model = kModel;
  config.heads_q = kHeadsQ;
  config.heads_kv = kHeadsKv;
  config.head_dim = kHeadDim;
  config.rope = RopeOptions{RopePairing::rotate_half, kRopeBase, 0};
  config.attention.threads = o.threads;
  config.attention.isa = o.isa;
  const Isa path = resolve_isa(o.isa);
  const int threads = o.threads > 0 ? o.threads : default_threads();

  progress(
      "setting up a Llama-3-8B-shaped layer (d=4096, H_q=32, H_kv=8, d_h=128, RoPE base "
      "500000), B=" +
      std::to_string(B) + ", T=" + std::to_string(T) + ", seed " + std::to_string(o.seed));
  CausalSelfAttention layer(config);
  layer.init_random(o.seed);
  const std::size_t n = static_cast<std::size_t>(B * T * d);
  const std::vector<float> u = random_normal(n, o.seed * 2654435761u + 1);
  const std::vector<float> d_out = random_normal(n, o.seed * 2654435761u + 2);
  std::vector<float> out(n);

  progress("forward (" + std::string(to_string(path)) + " kernels, " + std::to_string(threads) +
           " threads)");
  Stopwatch fwd_clock;
  layer.forward(u, B, T, out);
  const double fwd_s = fwd_clock.seconds();

  progress("backward");
  LayerGradients grads;
  Stopwatch bwd_clock;
  layer.backward(d_out, grads);
  const double bwd_s = bwd_clock.seconds();

  progress("check against the float64 reference");
  Stopwatch check_clock;
  const std::vector<CheckRow> checks = check_layer(layer, out, d_out, grads);
  const double check_s = check_clock.seconds();

  // Decode: prefill, then one token per step, against one forward over T + S tokens.
  const std::int64_t S = o.decode_steps;
  double prefill_s = 0.0, steps_s = 0.0, decode_err = 0.0;
  std::uint64_t cache_bytes = 0;
  if (S > 0) {
    progress("decode: prefill " + std::to_string(T) + " tokens into a " + to_string(o.cache_dtype) +
             " KV cache, then " + std::to_string(S) + " steps of one token");
    KVCacheConfig kc;
    kc.layers = 1;
    kc.batch = B;
    kc.heads_kv = kHeadsKv;
    kc.head_dim = kHeadDim;
    kc.capacity = T + S;
    kc.dtype = o.cache_dtype;
    KVCache cache(kc);
    cache_bytes = cache.memory_bytes();
    const std::vector<float> u_new = random_normal(static_cast<std::size_t>(B * S * d), o.seed * 2654435761u + 3);
    std::vector<float> prefill_out(n), step_in(static_cast<std::size_t>(B * d)),
        step_out(static_cast<std::size_t>(B * d)), generated(static_cast<std::size_t>(B * S * d));
    Stopwatch prefill_clock;
    layer.prefill(u, B, T, cache, 0, prefill_out);
    prefill_s = prefill_clock.seconds();
    Stopwatch steps_clock;
    for (std::int64_t s = 0; s < S; ++s) {
      for (std::int64_t b = 0; b < B; ++b)  // token s of every sequence: u_new [B, S, d]
        std::copy_n(u_new.begin() + (b * S + s) * d, d, step_in.begin() + b * d);
      layer.step(step_in, B, cache, 0, step_out);
      for (std::int64_t b = 0; b < B; ++b)
        std::copy_n(step_out.begin() + b * d, d, generated.begin() + (b * S + s) * d);
    }
    steps_s = steps_clock.seconds();

    progress("decode check: one forward over all " + std::to_string(T + S) + " tokens");
    std::vector<float> all_u(static_cast<std::size_t>(B * (T + S) * d)), all_out(all_u.size());
    for (std::int64_t b = 0; b < B; ++b) {
      std::copy_n(u.begin() + b * T * d, T * d, all_u.begin() + b * (T + S) * d);
      std::copy_n(u_new.begin() + b * S * d, S * d, all_u.begin() + (b * (T + S) + T) * d);
    }
    layer.forward(all_u, B, T + S, all_out);
    ErrorAccumulator acc;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < S * d; ++i)
        acc.add(generated[static_cast<std::size_t>(b * S * d + i)],
                all_out[static_cast<std::size_t>((b * (T + S) + T) * d + i)]);
    decode_err = acc.value();
  }

  // Useful work (SPEC "Useful-work counts"): attention 4·d_h·H_q·P·B forward, 2.5× backward;
  // projections 2·B·T·d·(2·H_q·d_h + 2·H_kv·d_h) forward (Q, K, V, O), 2× that backward.
  const double attn_f = forward_flops(B, T, T, kHeadsQ, kHeadDim, true, CausalAlign::bottom_right);
  const double attn_b = 2.5 * attn_f;
  const double proj_f = 2.0 * static_cast<double>(B) * static_cast<double>(T) *
                        static_cast<double>(d) *
                        static_cast<double>(2 * kHeadsQ * kHeadDim + 2 * kHeadsKv * kHeadDim);
  const double proj_b = 2.0 * proj_f;

  std::printf("\ntokenmix %s - Llama-3-8B-shaped causal self-attention layer\n", version());
  std::printf(
      "  B=%lld T=%lld d=%lld H_q=%lld H_kv=%lld (GQA, g=%lld) d_h=%lld, RoPE rotate-half "
      "base 500000\n",
      static_cast<long long>(B), static_cast<long long>(T), static_cast<long long>(d),
      static_cast<long long>(kHeadsQ), static_cast<long long>(kHeadsKv),
      static_cast<long long>(kHeadsQ / kHeadsKv), static_cast<long long>(kHeadDim));
  std::printf("  kernel path %s, %d threads, seed %llu\n\n", to_string(path), threads,
              static_cast<unsigned long long>(o.seed));

  std::printf("%-10s %10s %16s %17s %12s\n", "phase", "time [s]", "attention GFLOP",
              "projection GFLOP", "GFLOP/s");
  std::printf("%-10s %10.3f %16.2f %17.2f %12.1f\n", "forward", fwd_s, attn_f * 1e-9, proj_f * 1e-9,
              (attn_f + proj_f) / std::max(fwd_s, 1e-9) * 1e-9);
  std::printf("%-10s %10.3f %16.2f %17.2f %12.1f\n", "backward", bwd_s, attn_b * 1e-9,
              proj_b * 1e-9, (attn_b + proj_b) / std::max(bwd_s, 1e-9) * 1e-9);
  std::printf("%-10s %10.3f %16s %17s %12s\n", "check", check_s, "-", "-", "-");
  if (S > 0) {
    std::printf("%-10s %10.3f %16s %17s %12s   %.0f tokens/s\n", "prefill", prefill_s, "-", "-", "-",
                static_cast<double>(B * T) / std::max(prefill_s, 1e-9));
    std::printf("%-10s %10.3f %16s %17s %12s   %.1f tokens/s (%lld steps x B=%lld, %.2f ms/step)\n",
                "decode", steps_s, "-", "-", "-", static_cast<double>(B * S) / std::max(steps_s, 1e-9),
                static_cast<long long>(S), static_cast<long long>(B), steps_s / static_cast<double>(S) * 1e3);
  }
  std::printf(
      "  (useful FLOPs, SPEC \"Useful-work counts\": attention 4*d_h*H_q*P*B forward with\n"
      "   P = T(T+1)/2, 2.5x backward; projections 2*B*T*d*(2*H_q*d_h + 2*H_kv*d_h) "
      "forward, 2x backward)\n\n");

  double worst = 0.0;
  std::printf("%-58s %12s\n", "check vs float64 (max|x-r| / max|r|)", "rel. error");
  for (const CheckRow& c : checks) {
    if (c.skipped) {
      std::printf("  %-56s %12s\n", c.what.c_str(), "skipped");
      continue;
    }
    std::printf("  %-56s %12.2e\n", c.what.c_str(), c.error);
    worst = std::isnan(c.error) ? INFINITY : std::max(worst, c.error);
  }
  bool pass = worst <= kErrorBound;
  if (S > 0) {
    const double bound = o.cache_dtype == DType::f32 ? kErrorBound : kDecodeBoundLowPrecision;
    const bool ok = decode_err <= bound;
    std::printf("  %-56s %12.2e  (bound %.0e: %s)\n",
                ("decode: " + std::to_string(S) + " steps on a " + to_string(o.cache_dtype) + " cache vs forward").c_str(),
                decode_err, bound, ok ? "PASS" : "FAIL");
    pass = pass && ok;
  }
  std::printf("  %-56s %12.2e  (bound %.0e: %s)\n", "max", worst, kErrorBound,
              pass ? "PASS" : "FAIL");
  if (T <= kFullCheckMaxT)
    std::printf("  (*) relative to the largest reference entry of dW_Q, dW_K and dW_V together\n");
  std::printf("\n");

  // KV cache (SPEC 4.8): 2 · n · B · T · H_kv · d_h · sizeof(element), here n = B = T = 1.
  std::printf("KV cache of this layer per token (SPEC 4.8: 2 * H_kv * d_h * sizeof(element))\n");
  std::printf("  %-22s %12s %12s %18s\n", "", "fp32", "bf16/fp16", "fp32, B*T tokens");
  for (const auto& [name, hkv] : {std::pair<const char*, std::int64_t>{"GQA (H_kv = 8)", kHeadsKv},
                                  {"MHA (H_kv = 32)", kHeadsQ}}) {
    std::printf("  %-22s %10llu B %10llu B %18s\n", name,
                static_cast<unsigned long long>(kv_cache_bytes(1, 1, 1, hkv, kHeadDim, 4)),
                static_cast<unsigned long long>(kv_cache_bytes(1, 1, 1, hkv, kHeadDim, 2)),
                human_bytes(kv_cache_bytes(1, B, T, hkv, kHeadDim, 4)).c_str());
  }
  std::printf("  GQA holds %lldx less than MHA for the same layer\n",
              static_cast<long long>(kHeadsQ / kHeadsKv));
  if (S > 0) {
    std::printf("  decode-phase cache: %s, B=%lld x T_max=%lld positions: %s (KVCache::memory_bytes)\n",
                to_string(o.cache_dtype), static_cast<long long>(B), static_cast<long long>(T + S),
                human_bytes(cache_bytes).c_str());
  }
  std::fflush(stdout);
  if (!pass) {
    std::fprintf(stderr, "tokenmix: error: max relative error %.2e exceeds the bound %.0e\n", worst,
                 kErrorBound);
    return kExitCheckFailed;
  }
  return kExitOk;
}

}  // namespace tokenmix::cli
