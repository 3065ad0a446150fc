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
// Dropout (docs/design.md D.1–D.4, kernels/dropout.hpp): a dropped key's weight is 0 in O's
// sum and O is multiplied by 1 / (1 − p); the backward applies Z / (1 − p) to dP and to P in dV.
//
// Score variants (SPEC "Score variants used by real models", ScoreVariants in
// attention_kernels.hpp): each row loops only over its key range p.key_range(b, h, t) (causal
// mask ∩ window ∩ key length ∩ a boolean mask's row interval), the element-wise terms enter
// through p.score (soft-capping, ALiBi, a bias or general boolean mask; a boolean-masked key is
// skipped like an invisible one), and a sink σ_h is one more term of the softmax with no value:
// m starts at σ_h and l at e^{σ_h − shift}. Backward: p_u = e^{S_u − L_t} with the same S, and
// soft-capping's chain rule dz = dS · (1 − tanh²(z / c)).
//
// Non-finite inputs (SPEC 4.3, kernels/nonfinite.hpp): only visible keys are looped over, so a
// masked key takes no part; m is a NaN-propagating max, the shift is 0 while m = −∞, and every
// visible key's p multiplies its v even when p = 0 (0 · NaN = NaN), as the SIMD kernels do.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

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

// Copies n elements spaced `stride` apart into a contiguous fp32 row (bf16/f16 widened exactly).
template <class T>
inline void gather(const T* src, std::int64_t stride, std::int64_t n, float* dst) {
  if (std::is_same_v<T, float> && stride == 1) {
    std::transform(src, src + n, dst, [](T x) { return widen(x); });
  } else {
    for (std::int64_t i = 0; i < n; ++i) dst[i] = widen(src[i * stride]);
  }
}
// The fp32 row rounded once to T (nearest even; a plain copy for float) into a strided row.
template <class T>
inline void scatter(const float* src, std::int64_t n, T* dst, std::int64_t stride) {
  for (std::int64_t i = 0; i < n; ++i) dst[i * stride] = narrow<T>(src[i]);
}

// Packs rows [0, rows) of head `head` of a [B, T, H, d_h] tensor into contiguous [rows, d_h].
template <class T>
void pack_rows(const Strided<const T*>& x, std::int64_t b, std::int64_t head, std::int64_t row0,
               std::int64_t rows, std::int64_t dh, float* dst) {
  for (std::int64_t r = 0; r < rows; ++r) gather(x.row(b, row0 + r, head), x.s3, dh, dst + r * dh);
}

std::int64_t ceil_div(std::int64_t a, std::int64_t b) {
  return (a + b - 1) / b;
}

// The union [lo, hi) of the key ranges of rows [t0, t1) of (b, h) (empty: lo = hi = 0): the
// keys a block of query rows packs.
KeyRange block_keys(const AttentionProblem& p, std::int64_t b, std::int64_t h, std::int64_t t0,
                    std::int64_t t1) {
  KeyRange all{0, 0};
  bool any = false;
  for (std::int64_t t = t0; t < t1; ++t) {
    const KeyRange r = p.key_range(b, h, t);
    if (r.end <= r.begin) continue;
    all = any ? KeyRange{std::min(all.begin, r.begin), std::max(all.end, r.end)} : r;
    any = true;
  }
  return all;
}

// True when a general boolean mask excludes key u of row (b, h, t): the key takes no part.
inline bool bool_masked(const AttentionProblem& p, std::int64_t b, std::int64_t h, std::int64_t t,
                        std::int64_t u) {
  return p.var.mask_kind == MaskKind::boolean &&
         static_cast<const std::uint8_t*>(p.var.mask)[p.mask_offset(b, h, t, u)] == 0;
}

// For key u of row (b, h, t) with raw dot product ⟨q_t, k_u⟩ = qk, saved L_t (shifted by
// softmax_shift), dP̃_tu = ⟨dO_t, v_u⟩ = dp and D_t: the weight P̃_tu the values saw (into *a
// when given; A_tu, or A_tu Z_tu / (1 − p) with dropout) and the score gradient ds with respect
// to z = s·qk (SPEC "Backward pass"; soft-capping: dz = dS · (1 − tanh²(z / c)); dropout, D.4:
// dA = dp · Z / (1 − p)).
// Returns false for a key a general boolean mask excludes (it takes no part).
inline bool score_ds(const AttentionProblem& p, std::int64_t b, std::int64_t h, std::int64_t t,
                     std::int64_t u, float qk, float lse, float dp, float d_t, float* a,
                     float& ds) {
  // Dropout (D.4): the values saw P̃ = A ⊙ Z / (1 − p), so dA = dP̃ ⊙ Z / (1 − p) and dV takes P̃.
  const float drop = p.var.dropout.active ? p.var.dropout.factor(b, h, t, u) : 1.0f;
  dp *= drop;
  const float z = p.scale * qk;
  float su = z;
  if (p.var.elementwise()) {
    if (bool_masked(p, b, h, t, u)) return false;
    su = p.score(z, b, h, t, u);
  }
  const float pu = std::exp(su - lse);  // A_tu
  ds = pu * (dp - d_t);                 // dS_tu = A_tu (dA_tu − D_t)
  if (p.var.softcap > 0.0f) {
    const float th = std::tanh(z / p.var.softcap);
    ds *= 1.0f - th * th;  // ∂cap(z)/∂z
  }
  if (a != nullptr) *a = pu * drop;  // P̃ (A without dropout)
  return true;
}

// e^{σ_h − shift}: the sink's term of l (0 without sinks).
inline float sink_term(const AttentionProblem& p, std::int64_t h, float shift) {
  return p.var.sinks == nullptr ? 0.0f : std::exp(p.var.sinks[h] - shift);
}

}  // namespace

// The forward for activations of type T (float, bf16_t, f16_t): every operand is widened to fp32
// where it is gathered or packed, the arithmetic is the fp32 kernel's, O is rounded on store.
template <class T>
void attention_fwd_portable(const ForwardArgs& args) {
  const AttentionProblem& p = args.p;
  struct {
    Strided<const T*> q, k, v;
    Strided<T*> out;
    Out lse;
  } const a{as<T>(args.q), as<T>(args.k), as<T>(args.v), as<T>(args.out), args.lse};
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

    // The keys the rows of the block see (for the plain causal mask: [0, visible_end(t1 − 1))).
    const KeyRange keys = block_keys(p, b, h, t0, t1);
    const std::int64_t k0 = keys.begin;  // k_pack row i holds key k0 + i
    pack_rows(a.k, b, j, k0, keys.end - k0, dh, k_pack);
    pack_rows(a.v, b, j, k0, keys.end - k0, dh, v_pack);
    const bool elementwise = p.var.elementwise(), sinks = p.var.sinks != nullptr;
    const bool bool_mask = p.var.mask_kind == MaskKind::boolean;
    const Dropout& drop = p.var.dropout;
    for (std::int64_t t = t0; t < t1; ++t) {
      const auto [begin, end] = p.key_range(b, h, t);
      T* out = a.out.row(b, t, h);
      float lse = kNegInf;
      if (end <= begin) {  // no visible key: zeros and L = −∞ (SPEC 4.3), L = σ_h with a sink
        std::fill(acc, acc + dh, 0.0f);
        if (sinks) lse = p.var.sinks[h];
      } else {
        gather(a.q.row(b, t, h), a.q.s3, dh, q_row);
        float m = sinks ? p.var.sinks[h] : kNegInf;   // a sink is one more score (no value)
        for (std::int64_t u = begin; u < end; ++u) {  // S = s · q_t K_jᵀ  (4.2)
          const float z = p.scale * dot(q_row, k_pack + (u - k0) * dh, dh);
          const float su = elementwise ? p.score(z, b, h, t, u) : z;  // cap, ALiBi, mask
          score[u - k0] = su;
          m = max_nan(m, su);
        }
        const float shift = softmax_shift(m);  // every visible score −∞: P = 0, l = 0
        float l = sink_term(p, h, shift);
        std::fill(acc, acc + dh, 0.0f);
        for (std::int64_t u = begin; u < end; ++u) {  // A = softmax(S + M), O = A V  (4.4, 4.5)
          if (bool_mask && bool_masked(p, b, h, t, u)) continue;  // takes no part (SPEC 4.3)
          const float pu = std::exp(score[u - k0] - shift);
          l += pu;
          // Dropout (D.1): a dropped key's weight is 0 (still multiplied: 0 · NaN = NaN).
          const bool kept = !drop.active || drop.keep(b, h, t, u);
          axpy(kept ? pu : 0.0f, v_pack + (u - k0) * dh, acc, dh);
        }
        // l = 0 (no finite score): O = Õ / ∞ = 0 (NaN if a visible v was NaN or ±∞)
        const float div = l == 0.0f ? std::numeric_limits<float>::infinity() : l;
        for (std::int64_t i = 0; i < dh; ++i) acc[i] /= div;
        if (drop.active)  // P̃ = P ⊙ Z / (1 − p) (D.1)
          for (std::int64_t i = 0; i < dh; ++i) acc[i] *= drop.scale;
        lse = l == 0.0f ? kNegInf : m + std::log(l);
      }
      scatter(acc, dh, out, a.out.s3);
      if (a.lse.data != nullptr) a.lse.data[b * a.lse.s0 + h * a.lse.s1 + t * a.lse.s2] = lse;
    }
  }
}

// The backward for activations of type T, as the forward: widened on gather/pack, dQ, dK, dV
// rounded once on store.
template <class T>
void attention_bwd_portable(const BackwardArgs& args) {
  const AttentionProblem& p = args.p;
  struct {
    Strided<const T*> q, k, v, out;
    In lse;
    Strided<const T*> dout;
    Strided<T*> dq, dk, dv;
  } const a{as<T>(args.q),    as<T>(args.k),  as<T>(args.v),  as<T>(args.out), args.lse,
            as<T>(args.dout), as<T>(args.dq), as<T>(args.dk), as<T>(args.dv)};
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

      const KeyRange keys = block_keys(p, b, h, t0, t1);
      const std::int64_t k0 = keys.begin;  // k_pack row i holds key k0 + i
      pack_rows(a.k, b, j, k0, keys.end - k0, dh, k_pack);
      pack_rows(a.v, b, j, k0, keys.end - k0, dh, v_pack);

      for (std::int64_t t = t0; t < t1; ++t) {
        const auto [begin, end] = p.key_range(b, h, t);
        std::fill(dq_acc, dq_acc + dh, 0.0f);
        float d_t = 0.0f;
        if (end > begin) {
          gather(a.q.row(b, t, h), a.q.s3, dh, q_row);
          gather(a.dout.row(b, t, h), a.dout.s3, dh, do_row);
          gather(a.out.row(b, t, h), a.out.s3, dh, o_row);
          d_t = dot(do_row, o_row, dh);  // D_t = Σ_u A_tu dA_tu = ⟨dO_t, O_t⟩
          const float lse = softmax_shift(a.lse.data[b * a.lse.s0 + h * a.lse.s1 + t * a.lse.s2]);
          for (std::int64_t u = begin; u < end; ++u) {
            const float* k_u = k_pack + (u - k0) * dh;
            float ds = 0.0f;
            if (!score_ds(p, b, h, t, u, dot(q_row, k_u, dh), lse,
                          dot(do_row, v_pack + (u - k0) * dh, dh), d_t, nullptr, ds))
              continue;
            axpy(ds, k_u, dq_acc, dh);  // dS_tu k_u, dS = A ⊙ (dA − D)
          }
          for (std::int64_t i = 0; i < dh; ++i) dq_acc[i] *= p.scale;  // dQ = s · dS K
        }
        delta[(b * p.hq + h) * p.tq + t] = d_t;
        T* dq = a.dq.row(b, t, h);
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
      // With a window, row t sees keys > p(t) − W: rows t ≥ u1 − 1 + W − shift see none here.
      const std::int64_t t_end =
          p.var.window > 0 ? std::clamp<std::int64_t>(u1 - 1 + p.var.window - shift, 0, p.tq)
                           : p.tq;

      for (std::int64_t h = j * g; h < (j + 1) * g; ++h) {  // the query heads of group j (4.8)
        for (std::int64_t t = t_first; t < t_end; ++t) {
          const KeyRange r = p.key_range(b, h, t);
          const std::int64_t begin = std::max(r.begin, u0), end = std::min(r.end, u1);
          if (end <= begin) continue;  // row t sees no key of this block
          gather(a.q.row(b, t, h), a.q.s3, dh, q_row);
          gather(a.dout.row(b, t, h), a.dout.s3, dh, do_row);
          const float lse = softmax_shift(a.lse.data[b * a.lse.s0 + h * a.lse.s1 + t * a.lse.s2]);
          const float d_t = delta[(b * p.hq + h) * p.tq + t];
          for (std::int64_t u = begin; u < end; ++u) {
            const float* k_u = k_pack + (u - u0) * dh;
            float ds = 0.0f, pu = 0.0f;
            if (!score_ds(p, b, h, t, u, dot(q_row, k_u, dh), lse,
                          dot(do_row, v_pack + (u - u0) * dh, dh), d_t, &pu, ds))
              continue;
            axpy(ds, q_row, dk_acc + (u - u0) * dh, dh);   // dSᵀ Q
            axpy(pu, do_row, dv_acc + (u - u0) * dh, dh);  // Aᵀ dO (P̃ᵀ dO with dropout)
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

void attention_fwd_f32_portable(const ForwardArgs& args) {
  attention_fwd_portable<float>(args);
}
void attention_fwd_bf16_portable(const ForwardArgs& args) {
  attention_fwd_portable<bf16_t>(args);
}
void attention_fwd_f16_portable(const ForwardArgs& args) {
  attention_fwd_portable<f16_t>(args);
}
void attention_bwd_f32_portable(const BackwardArgs& args) {
  attention_bwd_portable<float>(args);
}
void attention_bwd_bf16_portable(const BackwardArgs& args) {
  attention_bwd_portable<bf16_t>(args);
}
void attention_bwd_f16_portable(const BackwardArgs& args) {
  attention_bwd_portable<f16_t>(args);
}

}  // namespace tokenmix::kernels
