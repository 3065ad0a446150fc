// src/kernels/portable/attention_decode_portable.cpp — decode attention over a KVCache in plain
// C++ (every CPU; the baseline the SIMD kernel is tested against). Unit contract: DecodeArgs in
// attention_kernels.hpp.
//
// Per unit (sequence b, KV head j, query block, key chunk [k0, k1)) and key tile of 64 keys:
//   K tile [d_h][64] and V rows [n_t][d_h] are widened to fp32 once (shared by all g·qblock rows)
//   s_u = scale · ⟨q_r, k_u⟩, masked to −∞ for u ≥ visible_end(r)            (4.2, 4.3)
//   online softmax (4.4): m' = max(m, max_u s_u), Õ ← Õ e^{m−m'} + Σ_u e^{s_u−m'} v_u,
//   l ← l e^{m−m'} + Σ_u e^{s_u−m'}                                             (4.5)
// and the unit stores (Õ, m, l) of each row; decode.cpp merges chunks and normalises.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include <omp.h>

#include "kernels/attention_kernels.hpp"
#include "kernels/kv_element.hpp"
#include "kernels/nonfinite.hpp"

namespace tokenmix::kernels {

void attention_decode_portable(const DecodeArgs& a) {
  const std::int64_t units = a.units(), rows = a.rows_max(), dh = a.dh, g = a.group();
  const std::int64_t T = kDecodeKeyTile;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const std::size_t esz = size_of(a.dtype);

#pragma omp for schedule(dynamic, 1)
  for (std::int64_t unit = 0; unit < units; ++unit) {
    const std::int64_t c = unit % a.chunks, qb = (unit / a.chunks) % a.qblocks;
    const std::int64_t j = (unit / (a.chunks * a.qblocks)) % a.hkv, b = unit / (a.chunks * a.qblocks * a.hkv);
    float* qs = a.scratch + omp_get_thread_num() * a.scratch_floats();  // s · q rows [rows][d_h]
    float* sc = qs + (rows * dh + 63) / 64 * 64;                        // scores [rows][64]
    float* kf = sc + rows * T;                                          // K tile [d_h][64], fp32
    float* vf = kf + T * dh;                                            // V rows [64][d_h], fp32
    float* acc = a.part_acc + unit * rows * dh;                        // Õ [rows][d_h]
    float* m_run = a.part_m + unit * rows;
    float* l_run = a.part_l + unit * rows;

    const std::int64_t t0 = qb * a.qblock, nrows = std::min(a.qblock, a.tnew - t0) * g;
    std::int64_t kend = 0;
    for (std::int64_t r = 0; r < nrows; ++r) {
      const float* q = a.q.row(b, t0 + r / g, j * g + r % g);
      for (std::int64_t x = 0; x < dh; ++x) qs[r * dh + x] = a.scale * q[x * a.q.s3];
      kend = std::max(kend, a.visible_end(b, t0 + r / g));
      m_run[r] = kNegInf;
      l_run[r] = 0.0f;
    }
    std::fill(acc, acc + rows * dh, 0.0f);
    const std::int64_t k0 = c * a.chunk, k1 = std::min(k0 + a.chunk, kend);

    for (std::int64_t u0 = k0; u0 < k1; u0 += T) {
      const std::int64_t nt = std::min(T, k1 - u0);
      const std::int64_t tile = a.tile_offset(b, j, u0) * static_cast<std::int64_t>(esz);
      const auto* kt = static_cast<const std::byte*>(a.k_layer) + tile;  // K tile [d_h][64]
      const auto* vt = static_cast<const std::byte*>(a.v_layer) + tile;  // V tile [64][d_h]
      for (std::int64_t i = 0; i < dh * T; ++i) kf[i] = load_element(a.dtype, kt, i);
      for (std::int64_t i = 0; i < nt * dh; ++i) vf[i] = load_element(a.dtype, vt, i);
      for (std::int64_t r = 0; r < nrows; ++r) {
        const std::int64_t end = a.visible_end(b, t0 + r / g);
        float* s = sc + r * T;
        std::fill(s, s + T, 0.0f);
        for (std::int64_t x = 0; x < dh; ++x) {  // s = (s·q) Kᵀ, keys along the tile  (4.2)
          const float qx = qs[r * dh + x];
          for (std::int64_t u = 0; u < T; ++u) s[u] += qx * kf[x * T + u];
        }
        float tmax = kNegInf;
        for (std::int64_t u = 0; u < nt; ++u) {
          if (u0 + u >= end) s[u] = kNegInf;  // (4.3)
          tmax = max_nan(tmax, s[u]);
        }
        // NaN-propagating max; shift 0 while no finite score is seen (P = e^{−∞} = 0, l = 0).
        const float m_new = max_nan(m_run[r], tmax), shift = softmax_shift(m_new);
        const float alpha = std::exp(m_run[r] - shift);
        float* o = acc + r * dh;
        if (m_new != m_run[r]) {
          for (std::int64_t x = 0; x < dh; ++x) o[x] *= alpha;
        }
        float sum = 0.0f;
        for (std::int64_t u = 0; u < nt; ++u) {  // Õ += P V  (4.4, 4.5)
          const float p = std::exp(s[u] - shift);
          sum += p;
          if (u0 + u < end) {  // every visible key, even with p = 0 (0 · NaN = NaN); no masked one
            for (std::int64_t x = 0; x < dh; ++x) o[x] += p * vf[u * dh + x];
          }
        }
        l_run[r] = l_run[r] * alpha + sum;
        m_run[r] = m_new;
      }
    }
  }
}

}  // namespace tokenmix::kernels
