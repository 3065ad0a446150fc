// tools/cli/layer_check.cpp — the checks of `tokenmix run` without files (layer_run.hpp).
//
// The check recomputes slices in float64 with the oracle (src/reference) from the tensors the
// forward saved (CausalSelfAttention::saved()), so it measures this run's kernels and GEMMs, not
// a second float32 computation:
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
// The decode check compares the tokens generated one at a time with the KV cache against one
// forward over all T + steps tokens: the cache must give the same attention (SPEC 4.3
// bottom-right, 4.8).
// Error metric everywhere: rel_err of the testing toolkit (testkit::ErrorAccumulator),
// max|x − r| / max|r| over the compared entries.
#include <omp.h>

#include <algorithm>
#include <string>
#include <vector>

#include "common.hpp"
#include "layer_run.hpp"

namespace tokenmix::cli::layer_run {
namespace {

using reference::Tensor64;

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
  return testkit::slice64(x, B, T, H, kHeadDim, t0, n);
}

}  // namespace

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
    const Tensor64 qg = testkit::slice64(s.q, B, T, Hq, D, 0, T, 0, g);
    const Tensor64 kg = testkit::slice64(s.k, B, T, Hkv, D, 0, T, 0, 1);
    const Tensor64 vg = testkit::slice64(s.v, B, T, Hkv, D, 0, T, 0, 1);
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

double check_decode(CausalSelfAttention& layer, std::span<const float> u,
                    std::span<const float> u_new, std::span<const float> generated, std::int64_t B,
                    std::int64_t T, std::int64_t S) {
  const std::int64_t d = kModel;
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
  return acc.value();
}

}  // namespace tokenmix::cli::layer_run
