// src/kernels/portable/attention_decode_portable.cpp — decode attention over a KVCache in plain
// C++ (every CPU; the baseline the SIMD kernel is tested against), one function per cache element
// type: attention_decode_<f32|bf16|f16|int8|fp8_e4m3>_portable. Quantized caches (SPEC
// "Quantized KV cache"): a closed K tile is widened to its codes c and its channel scales fold
// into the query rows once per tile (q·k̂_u = Σ_e (q_e δ_{τ,e}) c_{u,e}), the open tile is read as
// staged (fp32), V is widened to c · δ_u (per row). Unit contract: DecodeArgs in
// attention_kernels.hpp.
//
// Per unit (sequence b, KV head j, query block, key chunk [k0, k1)) and key tile of 64 keys:
//   K tile [d_h][64] and V rows [n_t][d_h] are widened to fp32 once (shared by all g·qblock rows)
//   z_u = scale · ⟨q_r, k_u⟩, S_u = cap(z_u) − m_h (p − u) (SPEC "Score variants": soft-capping,
//   ALiBi; DecodeArgs::score), masked to −∞ outside [visible_begin(r), visible_end(r)) (4.3 and
//   the window); tiles before the first row's window are not visited         (4.2, 4.3)
//   online softmax (4.4): m' = max(m, max_u S_u), Õ ← Õ e^{m−m'} + Σ_u e^{S_u−m'} v_u,
//   l ← l e^{m−m'} + Σ_u e^{S_u−m'}                                             (4.5)
// and the unit stores (Õ, m, l) of each row; decode.cpp merges chunks and normalises.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/attention_kernels.hpp"
#include "kernels/kernel_skeleton.hpp"
#include "kernels/kv_element.hpp"
#include "kernels/nonfinite.hpp"

namespace tokenmix::kernels {
namespace {

// One instantiation per cache element type (the element loads then need no run-time switch).
template <DType kDType>
void DecodeUnitsPortable(const DecodeArgs& a) {
  const std::int64_t units = a.units(), rows = a.rows_max(), dh = a.dh, g = a.group();
  constexpr std::int64_t kKeyTile = kDecodeKeyTile;  // keys per cache tile
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const std::size_t esz = size_of(kDType);
  // V rows read in place (DecodeArgs::v_rows: a short query block's caller tensor, row stride
  // vld) or from the V tiles (vld = d_h). A quantized cache's V rows need their tile's scales:
  // never in place (read_v_in_place).
  const bool v_in_place = a.v_in_place();
  const std::int64_t vld = a.v_stride();
  if constexpr (is_quantized(kDType)) {
    if (v_in_place) {
      throw UnsupportedError(
          "attention decode: a quantized cache's V rows cannot be read in place");
    }
  }

#pragma omp for schedule(dynamic, 1)
  for (std::int64_t unit = 0; unit < units; ++unit) {
    const auto [c, qb, j, b] = a.unit_at(unit);
    const int worker = omp_get_thread_num();
    float* qs = a.scratch.at(a.slots.q_scaled, worker);  // scale · q rows [rows][d_h]
    float* sc = a.scratch.at(a.slots.scores, worker);    // scores [rows][64]
    float* kf = a.scratch.at(a.slots.k_f32, worker);     // K tile [d_h][64], fp32
    float* vf = a.scratch.at(a.slots.v_f32, worker);     // V rows [64][d_h], fp32
    float* qf = a.scratch.at(a.slots.q_folded, worker);  // quantized: scale·q ⊙ δ_τ [rows][d_h]
    float* acc = a.part_acc + unit * rows * dh;          // Õ [rows][d_h]
    float* m_run = a.part_m + unit * rows;
    float* l_run = a.part_l + unit * rows;

    const std::int64_t t0 = qb * a.qblock, nrows = std::min(a.qblock, a.tnew - t0) * g;
    const DecodeArgs::KeyRange keys = a.key_range(b, t0, nrows / g);
    const std::int64_t kend = keys.end, kbegin = keys.begin;  // keys some row sees
    const std::int64_t k0 = a.chunk_base(b) + c * a.chunk, k1 = std::min(k0 + a.chunk, kend);
    // From the tile holding the first visible key (a window's start) on.
    const std::int64_t kb = std::max(k0, kbegin / kKeyTile * kKeyTile);
    std::fill(m_run, m_run + nrows, kNegInf);  // m = −∞, l = 0: the part is empty until a key
    std::fill(l_run, l_run + nrows, 0.0f);
    // Nothing visible in this chunk (past the last key of this query block — early blocks of a
    // long T_new —, a sequence with no key yet, or before a window): out before any per-row
    // work. The merge reads no part of it.
    if (kb >= k1) continue;
    for (std::int64_t r = 0; r < nrows; ++r) {
      const float* q = a.q.row(b, t0 + r / g, j * g + r % g);
      for (std::int64_t x = 0; x < dh; ++x) qs[r * dh + x] = a.scale * q[x * a.q.s3];
    }
    std::fill(acc, acc + rows * dh, 0.0f);

    for (std::int64_t u0 = kb; u0 < k1; u0 += kKeyTile) {
      const std::int64_t nt = std::min(kKeyTile, k1 - u0);
      const float* qk = qs;  // the query rows of the score product
      const std::int64_t tile = a.tile_offset(b, j, u0) * static_cast<std::int64_t>(esz);
      const auto* kt = static_cast<const std::byte*>(a.k_layer) + tile;  // K tile [d_h][64]
      const auto* vt =  // V rows [nt][d_h], row stride vld
          v_in_place ? static_cast<const std::byte*>(a.v_rows.data) +
                           a.v_row(b, j, u0) * static_cast<std::int64_t>(esz)
                     : static_cast<const std::byte*>(a.v_layer) + tile;
      if constexpr (is_quantized(kDType)) {
        // SPEC "Quantized KV cache": a closed K tile is k̂_{u,e} = c_{u,e} · δ_{τ,e}, its d_h
        // channel scales after it; the open tile (keys from open_start) is read unquantized from
        // the staging copy; V is x̂_u = c_u · δ_u, each row's scale after the V tile.
        float vs[kKeyTile];
        std::memcpy(vs, vt + a.layout.tile_elems(), sizeof vs);
        // q·k̂_u = Σ_e (q_e δ_{τ,e}) c_{u,e}: the channel scales fold into the query rows once
        // per tile (qk), K stays c.
        qk = qf;
        if (u0 == a.open_start(b)) {
          const float* open = a.open_tile(b, j);
          for (std::int64_t x = 0; x < dh; ++x)
            for (std::int64_t u = 0; u < nt; ++u) kf[x * kKeyTile + u] = open[x * kKeyTile + u];
          qk = qs;
        } else {
          for (std::int64_t x = 0; x < dh; ++x) {
            float delta = 0.0f;
            std::memcpy(&delta, kt + a.layout.tile_elems() + x * 4, sizeof delta);
            for (std::int64_t r = 0; r < nrows; ++r) qf[r * dh + x] = qs[r * dh + x] * delta;
            // (int8: the elements in the tiles' quads, a.layout.key_in_tile / value_in_tile)
            for (std::int64_t u = 0; u < nt; ++u)
              kf[x * kKeyTile + u] = load_element(kDType, kt, a.layout.key_in_tile(u, x));
          }
        }
        for (std::int64_t u = 0; u < nt; ++u)
          for (std::int64_t x = 0; x < dh; ++x)
            vf[u * dh + x] = load_element(kDType, vt, a.layout.value_in_tile(u, x)) * vs[u];
      } else {
        for (std::int64_t x = 0; x < dh; ++x)  // the tile's nt keys only (the rest is not read)
          for (std::int64_t u = 0; u < nt; ++u)
            kf[x * kKeyTile + u] = load_element(kDType, kt, x * kKeyTile + u);
        for (std::int64_t u = 0; u < nt; ++u)
          for (std::int64_t x = 0; x < dh; ++x)
            vf[u * dh + x] = load_element(kDType, vt, u * vld + x);
      }
      for (std::int64_t r = 0; r < nrows; ++r) {
        const std::int64_t t = t0 + r / g, h = j * g + r % g;
        const std::int64_t end = a.visible_end(b, t), begin = a.visible_begin(b, t);
        float* score = sc + r * kKeyTile;
        std::fill(score, score + nt, 0.0f);
        for (std::int64_t x = 0; x < dh; ++x) {  // scores = (scale·q) Kᵀ, keys in the tile (4.2)
          const float qx = qk[r * dh + x];
          for (std::int64_t u = 0; u < nt; ++u) score[u] += qx * kf[x * kKeyTile + u];
        }
        float tmax = kNegInf;
        for (std::int64_t u = 0; u < nt; ++u) {
          const bool visible = u0 + u >= begin && u0 + u < end;  // (4.3), window
          score[u] = visible ? a.score(score[u], b, h, t, u0 + u) : kNegInf;
          tmax = max_nan(tmax, score[u]);
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
          const float p = std::exp(score[u] - shift);
          sum += p;
          if (u0 + u >= begin && u0 + u < end) {  // every visible key, even with p = 0 (0 · NaN
                                                  // = NaN); no masked one
            for (std::int64_t x = 0; x < dh; ++x) o[x] += p * vf[u * dh + x];
          }
        }
        l_run[r] = l_run[r] * alpha + sum;
        m_run[r] = m_new;
      }
    }
  }
}

}  // namespace

void attention_decode_f32_portable(const DecodeArgs& a) {
  DecodeUnitsPortable<DType::f32>(a);
}
void attention_decode_bf16_portable(const DecodeArgs& a) {
  DecodeUnitsPortable<DType::bf16>(a);
}
void attention_decode_f16_portable(const DecodeArgs& a) {
  DecodeUnitsPortable<DType::f16>(a);
}
void attention_decode_int8_portable(const DecodeArgs& a) {
  DecodeUnitsPortable<DType::int8>(a);
}
void attention_decode_fp8_e4m3_portable(const DecodeArgs& a) {
  DecodeUnitsPortable<DType::fp8_e4m3>(a);
}

}  // namespace tokenmix::kernels
