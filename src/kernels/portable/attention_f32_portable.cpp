// src/kernels/portable/attention_f32_portable.cpp — exact fp32 attention, forward and backward,
// in plain C++ that any CPU runs. It is the always-available path and the baseline the SIMD
// flash kernels are measured against; it favours clarity over speed.
//
// Forward (SPEC 4.2–4.5), one query row t of head h at a time, against KV head j = h / g (4.8):
//   s_u = scale · ⟨q_t, k_u⟩ for visible u (4.2, 4.3)    m = max_u s_u
//   p_u = exp(s_u − m),  l = Σ_u p_u                     (4.4, stable form)
//   o_t = (Σ_u p_u v_u) / l,  L_t = m + log l
// Extra memory per worker: K_j and V_j rows of the block (packed contiguous) plus one score row,
// i.e. O(T_k · d_h); never a T×T matrix.
//
// Backward (SPEC "Backward pass") in two passes, each output row owned by one work unit, so the
// result is deterministic and independent of the thread count:
//   pass 1, per query row t:  D_t = ⟨dO_t, O_t⟩;  p_u = exp(s_u − L_t);  dp_u = ⟨dO_t, v_u⟩;
//                             ds_u = p_u (dp_u − D_t)  (J·g of 4.7 row by row);  dq_t = s Σ_u ds_u
//                             k_u
//   pass 2, per key row u of KV head j, summing over the g query heads of its group and over the
//                             queries that see u:  dk_u = s Σ ds_tu q_t,  dv_u = Σ p_tu dO_t
// Pass 2 recomputes p and ds instead of storing them (no T×T buffer).
//
// Non-finite inputs (SPEC 4.3, kernels/nonfinite.hpp): only visible keys are looped over, so a
// masked key takes no part; m is a NaN-propagating max, the shift is 0 while m = −∞, and every
// visible key's p multiplies its v even when p = 0 (0 · NaN = NaN), as the SIMD kernels do.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/attention_kernels.hpp"
#include "kernels/kernel_skeleton.hpp"
#include "kernels/nonfinite.hpp"

namespace tokenmix::kernels {
namespace {

constexpr std::int64_t kRowBlock =
    64;  // query rows (forward, pass 1) or key rows (pass 2) per unit

// ⟨a, b⟩ of two contiguous rows with 8 independent partial sums: a fixed summation order (so
// results never depend on threads) that compilers vectorise without -ffast-math.
inline float dot(const float* a, const float* b, std::int64_t n) {
  float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += a[i + j] * b[i + j];
  }
  float tail = 0.0f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail;
}

// y += alpha · x over n contiguous elements.
inline void axpy(float alpha, const float* x, float* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] += alpha * x[i];
}

// Copies n elements spaced `stride` apart into a contiguous row.
inline void gather(const float* src, std::int64_t stride, std::int64_t n, float* dst) {
  if (stride == 1) {
    std::copy(src, src + n, dst);
  } else {
    for (std::int64_t i = 0; i < n; ++i) dst[i] = src[i * stride];
  }
}
inline void scatter(const float* src, std::int64_t n, float* dst, std::int64_t stride) {
  for (std::int64_t i = 0; i < n; ++i) dst[i * stride] = src[i];
}

// Packs rows [0, rows) of head `head` of a [B, T, H, d_h] tensor into contiguous [rows, d_h].
void pack_rows(const In& x, std::int64_t b, std::int64_t head, std::int64_t row0, std::int64_t rows,
               std::int64_t dh, float* dst) {
  for (std::int64_t r = 0; r < rows; ++r) gather(x.row(b, row0 + r, head), x.s3, dh, dst + r * dh);
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

}  // namespace

void attention_fwd_f32_portable(const ForwardArgs& a) {
  const AttentionProblem& p = a.p;
  const std::int64_t dh = p.dh, g = p.group();
  const std::int64_t blocks = ceil_div(p.tq, kRowBlock);
  const std::int64_t units = p.batch * p.hq * blocks;
  if (units == 0) return;
  const int team = team_size(p.threads, units);

  // Per-worker scratch, allocated here so an allocation failure throws in the caller's thread:
  // K_j and V_j packed [T_k, d_h] each, one score row [T_k], q_t and the output accumulator.
  ScratchLayout layout(p.site);
  const auto k_slot = layout.add<float>(scratch_mul(p.tk, dh, p.site, "packed K rows"));
  const auto v_slot = layout.add<float>(scratch_mul(p.tk, dh, p.site, "packed V rows"));
  const auto score_slot = layout.add<float>(p.tk);
  const auto q_slot = layout.add<float>(dh);
  const auto acc_slot = layout.add<float>(dh);
  const ScratchArena scratch(layout, team, "the per-worker scratch");
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#pragma omp parallel for schedule(dynamic, 1) num_threads(team)
  for (std::int64_t unit = 0; unit < units; ++unit) {
    const auto [block_rev, h, b] = Unravel(unit, blocks, p.hq);
    // Late query blocks see the most keys: hand them out first (causal load balance).
    const std::int64_t block = blocks - 1 - block_rev, j = h / g;
    const std::int64_t t0 = block * kRowBlock, t1 = std::min(p.tq, t0 + kRowBlock);

    const int worker = omp_get_thread_num();
    float* k_pack = scratch.at(k_slot, worker);     // [T_k, d_h]
    float* v_pack = scratch.at(v_slot, worker);     // [T_k, d_h]
    float* score = scratch.at(score_slot, worker);  // [T_k]
    float* q_row = scratch.at(q_slot, worker);      // [d_h]
    float* acc = scratch.at(acc_slot, worker);      // [d_h]

    // visible_end is non-decreasing in t: the last row of the block sees the most keys.
    const std::int64_t keys = std::max<std::int64_t>(0, p.visible_end(t1 - 1));
    pack_rows(a.k, b, j, 0, keys, dh, k_pack);
    pack_rows(a.v, b, j, 0, keys, dh, v_pack);

    for (std::int64_t t = t0; t < t1; ++t) {
      const std::int64_t end = p.visible_end(t);
      float* out = a.out.data + b * a.out.s0 + t * a.out.s1 + h * a.out.s2;
      float lse = kNegInf;
      if (end <= 0) {  // no visible key (T_q > T_k, bottom-right): zeros and L = −∞ (SPEC 4.3)
        std::fill(acc, acc + dh, 0.0f);
      } else {
        gather(a.q.row(b, t, h), a.q.s3, dh, q_row);
        float m = kNegInf;
        for (std::int64_t u = 0; u < end; ++u) {  // S = s · q_t K_jᵀ  (4.2)
          score[u] = p.scale * dot(q_row, k_pack + u * dh, dh);
          m = max_nan(m, score[u]);
        }
        float l = 0.0f;
        std::fill(acc, acc + dh, 0.0f);
        const float shift = softmax_shift(m);     // every visible score −∞: P = 0, l = 0
        for (std::int64_t u = 0; u < end; ++u) {  // A = softmax(S + M), O = A V  (4.4, 4.5)
          const float pu = std::exp(score[u] - shift);
          l += pu;
          axpy(pu, v_pack + u * dh, acc, dh);
        }
        // l = 0 (no finite score): O = Õ / ∞ = 0 (NaN if a visible v was NaN or ±∞)
        const float div = l == 0.0f ? std::numeric_limits<float>::infinity() : l;
        for (std::int64_t i = 0; i < dh; ++i) acc[i] /= div;
        lse = l == 0.0f ? kNegInf : m + std::log(l);
      }
      scatter(acc, dh, out, a.out.s3);
      if (a.lse.data != nullptr) a.lse.data[b * a.lse.s0 + h * a.lse.s1 + t * a.lse.s2] = lse;
    }
  }
}

void attention_bwd_f32_portable(const BackwardArgs& a) {
  const AttentionProblem& p = a.p;
  const std::int64_t dh = p.dh, g = p.group();

  // D[b, h, t] = ⟨dO_t, O_t⟩, filled by pass 1 and read by pass 2.
  ScratchLayout delta_layout(p.site);
  const auto delta_slot = delta_layout.add<float>(
      scratch_mul(scratch_mul(p.batch, p.hq, p.site, "D"), p.tq, p.site, "D"));
  const ScratchArena delta_memory(delta_layout, 1, "D = rowsum(dO * O)");
  float* delta = delta_memory.at(delta_slot, 0);

  // ---- Pass 1: D and dQ, one unit per (b, h, block of query rows). ----
  {
    const std::int64_t blocks = ceil_div(p.tq, kRowBlock);
    const std::int64_t units = p.batch * p.hq * blocks;
    const int team = team_size(p.threads, units);
    ScratchLayout layout(p.site);
    const auto k_slot = layout.add<float>(scratch_mul(p.tk, dh, p.site, "packed K rows"));
    const auto v_slot = layout.add<float>(scratch_mul(p.tk, dh, p.site, "packed V rows"));
    const auto rows_slot = layout.add<float>(scratch_mul(4, dh, p.site, "q, dO, O, dq rows"));
    const ScratchArena scratch(layout, units ? team : 0, "the per-worker scratch of pass 1 (dQ)");

#pragma omp parallel for schedule(dynamic, 1) num_threads(team)
    for (std::int64_t unit = 0; unit < units; ++unit) {
      const auto [block_rev, h, b] = Unravel(unit, blocks, p.hq);
      const std::int64_t block = blocks - 1 - block_rev, j = h / g;
      const std::int64_t t0 = block * kRowBlock, t1 = std::min(p.tq, t0 + kRowBlock);

      const int worker = omp_get_thread_num();
      float* k_pack = scratch.at(k_slot, worker);    // [T_k, d_h]
      float* v_pack = scratch.at(v_slot, worker);    // [T_k, d_h]
      float* q_row = scratch.at(rows_slot, worker);  // [d_h] each:
      float* do_row = q_row + dh;
      float* o_row = do_row + dh;
      float* dq_acc = o_row + dh;

      const std::int64_t keys = std::max<std::int64_t>(0, p.visible_end(t1 - 1));
      pack_rows(a.k, b, j, 0, keys, dh, k_pack);
      pack_rows(a.v, b, j, 0, keys, dh, v_pack);

      for (std::int64_t t = t0; t < t1; ++t) {
        const std::int64_t end = p.visible_end(t);
        std::fill(dq_acc, dq_acc + dh, 0.0f);
        float d_t = 0.0f;
        if (end > 0) {
          gather(a.q.row(b, t, h), a.q.s3, dh, q_row);
          gather(a.dout.row(b, t, h), a.dout.s3, dh, do_row);
          gather(a.out.row(b, t, h), a.out.s3, dh, o_row);
          d_t = dot(do_row, o_row, dh);  // D_t = Σ_u A_tu dA_tu = ⟨dO_t, O_t⟩
          const float lse = softmax_shift(a.lse.data[b * a.lse.s0 + h * a.lse.s1 + t * a.lse.s2]);
          for (std::int64_t u = 0; u < end; ++u) {
            const float pu = std::exp(p.scale * dot(q_row, k_pack + u * dh, dh) - lse);  // A_tu
            const float dpu = dot(do_row, v_pack + u * dh, dh);                          // dA_tu
            axpy(pu * (dpu - d_t), k_pack + u * dh, dq_acc, dh);  // dS_tu k_u, dS = A ⊙ (dA − D)
          }
          for (std::int64_t i = 0; i < dh; ++i) dq_acc[i] *= p.scale;  // dQ = s · dS K
        }
        delta[(b * p.hq + h) * p.tq + t] = d_t;
        float* dq = a.dq.data + b * a.dq.s0 + t * a.dq.s1 + h * a.dq.s2;
        scatter(dq_acc, dh, dq, a.dq.s3);
      }
    }
  }

  // ---- Pass 2: dK and dV, one unit per (b, KV head j, block of key rows). ----
  {
    const std::int64_t blocks = ceil_div(p.tk, kRowBlock);
    const std::int64_t units = p.batch * p.hkv * blocks;
    const int team = team_size(p.threads, units);
    ScratchLayout layout(p.site);
    // K, V, dK and dV rows of the block [kRowBlock, d_h] each (dK and dV zeroed together).
    const auto block_slot = layout.add<float>(scratch_mul(4 * kRowBlock, dh, p.site, "key block"));
    const auto rows_slot = layout.add<float>(scratch_mul(2, dh, p.site, "q and dO rows"));
    const ScratchArena scratch(layout, units ? team : 0,
                               "the per-worker scratch of pass 2 (dK, dV)");
    // First query that sees key u: visible_end(t) > u  ⟺  t ≥ u − shift (causal).
    const std::int64_t shift = p.align == CausalAlign::bottom_right ? p.tk - p.tq : 0;

#pragma omp parallel for schedule(dynamic, 1) num_threads(team)
    for (std::int64_t unit = 0; unit < units; ++unit) {
      // Early key blocks are seen by the most queries: block = unit % blocks comes first.
      const auto [block, j, b] = Unravel(unit, blocks, p.hkv);
      const std::int64_t u0 = block * kRowBlock, u1 = std::min(p.tk, u0 + kRowBlock);
      const std::int64_t n = u1 - u0;

      const int worker = omp_get_thread_num();
      float* k_pack = scratch.at(block_slot, worker);  // [n, d_h]
      float* v_pack = k_pack + kRowBlock * dh;         // [n, d_h]
      float* dk_acc = v_pack + kRowBlock * dh;         // [n, d_h]
      float* dv_acc = dk_acc + kRowBlock * dh;         // [n, d_h]
      float* q_row = scratch.at(rows_slot, worker);    // [d_h]
      float* do_row = q_row + dh;                      // [d_h]

      pack_rows(a.k, b, j, u0, n, dh, k_pack);
      pack_rows(a.v, b, j, u0, n, dh, v_pack);
      std::fill(dk_acc, dk_acc + 2 * kRowBlock * dh, 0.0f);
      const std::int64_t t_first = p.causal ? std::max<std::int64_t>(0, u0 - shift) : 0;

      for (std::int64_t h = j * g; h < (j + 1) * g; ++h) {  // the query heads of group j (4.8)
        for (std::int64_t t = t_first; t < p.tq; ++t) {
          const std::int64_t end = std::min(p.visible_end(t), u1);  // keys u0 ≤ u < end seen by t
          if (end <= u0) continue;
          gather(a.q.row(b, t, h), a.q.s3, dh, q_row);
          gather(a.dout.row(b, t, h), a.dout.s3, dh, do_row);
          const float lse = softmax_shift(a.lse.data[b * a.lse.s0 + h * a.lse.s1 + t * a.lse.s2]);
          const float d_t = delta[(b * p.hq + h) * p.tq + t];
          for (std::int64_t u = u0; u < end; ++u) {
            const float* k_u = k_pack + (u - u0) * dh;
            const float pu = std::exp(p.scale * dot(q_row, k_u, dh) - lse);  // A_tu
            const float dpu = dot(do_row, v_pack + (u - u0) * dh, dh);       // dA_tu
            axpy(pu * (dpu - d_t), q_row, dk_acc + (u - u0) * dh, dh);       // dSᵀ Q
            axpy(pu, do_row, dv_acc + (u - u0) * dh, dh);                    // Aᵀ dO
          }
        }
      }
      for (std::int64_t r = 0; r < n; ++r) {
        for (std::int64_t i = 0; i < dh; ++i) dk_acc[r * dh + i] *= p.scale;  // dK = s · dSᵀ Q
        scatter(dk_acc + r * dh, dh, a.dk.row(b, u0 + r, j), a.dk.s3);
        scatter(dv_acc + r * dh, dh, a.dv.row(b, u0 + r, j), a.dv.s3);
      }
    }
  }
}

}  // namespace tokenmix::kernels
