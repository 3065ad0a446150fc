// src/api/weights.cpp — attention weights on request (tokenmix/attention.hpp, attention_weights).
//
// For the selected heads h and query rows t (SPEC 4.2–4.4, "Score variants used by real models"):
//   z_{t,u} = s·⟨q_t, k_u⟩                                     (4.2)
//   S_{t,u} = cap(z) + b_h(t,u) + bias_{b,h,t,u}               (AttentionProblem::score)
//   P_{t,u} = exp(S_{t,u} − L_t) for u in the row's keys, else 0   (4.3, 4.4)
//   and with options.dropout P̃ = P ⊙ Z / (1 − p)                  (D.1, kernels/dropout.hpp)
// with L_t the forward's saved log-sum-exp and the row's keys AttentionProblem::key_range (causal
// mask, window, key length, interval mask): the same scalar score and the same key ranges as the
// kernels, so P is the A of the forward row for row. Nothing T×T is formed beyond the output.
//
// Work: units of (b, selected head, block of kRows query rows); per unit the rows of Q_h are
// widened to fp32 once, and per block of kKeys keys the panel K_jᵀ [d_h][kKeys] is widened and
// multiplied with the rows by the small-GEMM chunk of the call's path (kernels/small_gemm.hpp:
// the same bits on every path). Key blocks that no row of the unit sees are written as zeros
// without a product. Every output element is one fixed computation, whichever thread does it:
// the results do not depend on the thread count or the path.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "api/problem.hpp"
#include "api/variants.hpp"
#include "kernels/attention_kernels.hpp"
#include "kernels/kernel_skeleton.hpp"
#include "kernels/kv_element.hpp"
#include "kernels/scratch_arena.hpp"
#include "kernels/small_gemm.hpp"
#include "tokenmix/attention.hpp"
#include "tokenmix/error.hpp"
#include "tokenmix/runtime.hpp"
#include "util/validate.hpp"

namespace tokenmix {
namespace {

using detail::fail;

constexpr std::int64_t kRows = 64;  // query rows per unit
constexpr std::int64_t kKeys = 64;  // keys per K_jᵀ panel

std::string str(std::int64_t x) {
  return std::to_string(x);
}

// The selected heads (every head when select.heads is empty), each checked against [0, H_q).
std::vector<std::int64_t> selected_heads(const char* fn, const WeightsSelection& select,
                                         std::int64_t hq) {
  std::vector<std::int64_t> heads = select.heads;
  if (heads.empty()) {
    heads.resize(static_cast<std::size_t>(hq));
    std::iota(heads.begin(), heads.end(), std::int64_t{0});
  }
  for (std::size_t i = 0; i < heads.size(); ++i) {
    if (heads[i] < 0 || heads[i] >= hq) {
      fail(ErrorCode::invalid_argument, fn,
           "select.heads[" + std::to_string(i) + "] must be a query head in [0, H_q = " + str(hq) +
               ") (q.shape[2]); got " + str(heads[i]));
    }
  }
  return heads;
}

// The per-worker buffers of one call.
struct WeightsScratch {
  kernels::Slot<float> q_rows;  // [kRows][d_h]  Q_h rows of the unit, fp32
  kernels::Slot<float> k_t;     // [d_h][kKeys]  K_jᵀ panel, fp32
  kernels::Slot<float> dots;    // [kRows][kKeys] ⟨q_t, k_u⟩
  WeightsScratch(kernels::ScratchLayout& layout, std::int64_t dh)
      : q_rows(layout.add<float>(kernels::scratch_mul(kRows, dh, layout.site(), "query rows"))),
        k_t(layout.add<float>(kernels::scratch_mul(kKeys, dh, layout.site(), "a K panel"))),
        dots(layout.add<float>(kRows * kKeys)) {}
};

}  // namespace

void attention_weights(ConstTensorView q, ConstTensorView k, ConstTensorView lse,
                       TensorView weights, const AttentionOptions& options,
                       const WeightsSelection& select) {
  constexpr const char* fn = "attention_weights";
  detail::VariantData variants;
  const kernels::AttentionProblem p = detail::make_problem(fn, q, k, nullptr, options, variants);
  // SPEC "Reduced precision": q and k share one dtype (widened exactly); lse and P are f32.
  const DType dtype = detail::common_dtype(fn, {{"q", q}, {"k", k}}, "q and k");
  detail::check_lse(fn, lse, "lse", p);
  const std::vector<std::int64_t> heads = selected_heads(fn, select, p.hq);
  const std::int64_t row_begin = select.row_begin, row_end = select.row_end.value_or(p.tq);
  if (row_begin < 0 || row_end < row_begin || row_end > p.tq) {
    fail(ErrorCode::invalid_argument, fn,
         "select.row_begin and select.row_end must satisfy 0 <= row_begin <= row_end <= T_q = " +
             str(p.tq) + " (q.shape[1]); got row_begin = " + str(row_begin) +
             ", row_end = " + str(row_end));
  }
  const auto nheads = static_cast<std::int64_t>(heads.size());
  const std::int64_t rows = row_end - row_begin;
  detail::check_view(weights, 4, fn, "weights");  // f32 (UnsupportedError otherwise), extents
  detail::check_dim(weights, 0, p.batch, fn, "weights", "B", "q.shape[0]");
  detail::check_dim(weights, 1, nheads, fn, "weights", "heads",
                    select.heads.empty() ? "q.shape[2] (H_q: every head)" : "select.heads.size()");
  detail::check_dim(weights, 2, rows, fn, "weights", "rows", "select.row_end - select.row_begin");
  detail::check_dim(weights, 3, p.tk, fn, "weights", "T_k", "k.shape[1]");
  detail::check_no_overlap(fn, {{"weights", weights}},
                           {{"q", q},
                            {"k", k},
                            {"lse", lse},
                            {"options.mask", detail::mask_if_f32(options)},
                            {"options.alibi_slopes", options.alibi_slopes},
                            {"options.sinks", options.sinks}});
  detail::check_bool_mask_disjoint(fn, options, {{"weights", weights}});
  const Isa isa = resolve_isa(options.isa, fn);
  const kernels::SmallGemmChunk chunk = kernels::small_gemm_chunk(isa);
  if (p.batch == 0 || nheads == 0 || rows == 0 || p.tk == 0) return;  // no element to write

  const kernels::CallSite site{fn, "attention_weights"};
  kernels::ScratchLayout layout(site);
  const WeightsScratch slots(layout, p.dh);
  const std::int64_t row_blocks = (rows + kRows - 1) / kRows;
  const std::int64_t units = detail::checked_mul(
      detail::checked_mul(p.batch, nheads, fn, "B * heads"), row_blocks, fn, "work units");
  const int team = kernels::team_size(p.threads, units);
  const kernels::ScratchArena arena(layout, team, "attention weights scratch");

  const auto qs = detail::strided(q), ks = detail::strided(k), ls = detail::strided(lse);
  const auto ws = detail::strided(weights);
  const std::int64_t dh = p.dh, group = p.group();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();

#pragma omp parallel num_threads(team)
  {
    const int worker = omp_get_thread_num();
    float* q_rows = arena.at(slots.q_rows, worker);
    float* k_t = arena.at(slots.k_t, worker);
    float* dots = arena.at(slots.dots, worker);
    kernels::KeyRange range[kRows];
    float row_lse[kRows];
#pragma omp for schedule(dynamic)
    for (std::int64_t unit = 0; unit < units; ++unit) {
      const std::int64_t rb = unit % row_blocks, i = unit / row_blocks % nheads,
                         b = unit / (row_blocks * nheads);
      const std::int64_t h = heads[static_cast<std::size_t>(i)], j = h / group;  // (4.8)
      const std::int64_t t0 = row_begin + rb * kRows, n = std::min(kRows, row_end - t0);
      // The unit's rows: Q_h widened, the keys each row sees and its L; their keys' hull.
      std::int64_t first = p.tk, last = 0;
      for (std::int64_t r = 0; r < n; ++r) {
        const std::int64_t t = t0 + r, at = b * qs.s0 + t * qs.s1 + h * qs.s2;
        for (std::int64_t e = 0; e < dh; ++e)
          q_rows[r * dh + e] = kernels::load_element(dtype, qs.data, at + e * qs.s3);
        range[r] = p.key_range(b, h, t);
        row_lse[r] = ls.data[b * ls.s0 + h * ls.s1 + t * ls.s2];
        if (range[r].begin < range[r].end) {
          first = std::min(first, range[r].begin);
          last = std::max(last, range[r].end);
        }
      }
      float* out = ws.data + b * ws.s0 + i * ws.s1 + (t0 - row_begin) * ws.s2;
      for (std::int64_t u0 = 0; u0 < p.tk; u0 += kKeys) {
        const std::int64_t m = std::min(kKeys, p.tk - u0);
        if (u0 + m <= first || u0 >= last) {  // no row sees a key of this block: P = 0
          for (std::int64_t r = 0; r < n; ++r)
            for (std::int64_t c = 0; c < m; ++c) out[r * ws.s2 + (u0 + c) * ws.s3] = 0.0f;
          continue;
        }
        // K_jᵀ [d_h][m], widened; then dots [n][m] = Q_h rows · K_jᵀ (4.2, before the scale).
        for (std::int64_t c = 0; c < m; ++c) {
          const std::int64_t at = b * ks.s0 + (u0 + c) * ks.s1 + j * ks.s2;
          for (std::int64_t e = 0; e < dh; ++e)
            k_t[e * m + c] = kernels::load_element(dtype, ks.data, at + e * ks.s3);
        }
        chunk(n, dh, q_rows, k_t, m, 0, dh, dots, kKeys);
        for (std::int64_t r = 0; r < n; ++r) {
          const std::int64_t t = t0 + r;
          for (std::int64_t c = 0; c < m; ++c) {
            const std::int64_t u = u0 + c;
            float w = 0.0f;  // a key outside the row's range: M = −∞ (4.3), P = 0
            if (u >= range[r].begin && u < range[r].end) {
              const float x = p.score(p.scale * dots[r * kKeys + c], b, h, t, u);
              // exp(S + M − L) (4.4); a −∞ score (boolean mask, −∞ bias) is exactly 0 even where
              // L = −∞ (the difference would be NaN).
              if (x != kNegInf)
                w = static_cast<float>(
                    std::exp(static_cast<double>(x) - static_cast<double>(row_lse[r])));
              // With dropout, the weights the forward averaged the values with: P̃ = P ⊙ Z /
              // (1 − p) (D.1).
              if (p.var.dropout.active) w *= p.var.dropout.factor(b, h, t, u);
            }
            out[r * ws.s2 + u * ws.s3] = w;
          }
        }
      }
    }
  }
}

}  // namespace tokenmix
