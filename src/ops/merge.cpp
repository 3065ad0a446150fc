// src/ops/merge.cpp — combining attention over disjoint key sets (SPEC "Merging partial results").
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "kernels/nonfinite.hpp"
#include "tokenmix/attention.hpp"
#include "util/validate.hpp"

namespace tokenmix {
namespace {

bool same_view(const ConstTensorView& a, const ConstTensorView& b) {
  return a.data == b.data && a.rank == b.rank && a.shape == b.shape && a.strides == b.strides;
}

}  // namespace

void merge_partials(ConstTensorView o1, ConstTensorView lse1, ConstTensorView o2,
                    ConstTensorView lse2, TensorView out, TensorView lse_out) {
  constexpr const char* fn = "merge_partials";
  using detail::check_dim;
  detail::check_view(o1, 4, fn, "o1");
  const std::int64_t B = o1.dim(0), T = o1.dim(1), H = o1.dim(2), D = o1.dim(3);
  for (auto [name, v] : {std::pair{"o2", o2}, std::pair{"out", ConstTensorView(out)}}) {
    detail::check_view(v, 4, fn, name);
    check_dim(v, 0, B, fn, name, "B", "o1.shape[0]");
    check_dim(v, 1, T, fn, name, "T", "o1.shape[1]");
    check_dim(v, 2, H, fn, name, "H", "o1.shape[2]");
    check_dim(v, 3, D, fn, name, "d_h", "o1.shape[3]");
  }
  for (auto [name, v] : {std::pair{"lse1", lse1}, std::pair{"lse2", lse2},
                         std::pair{"lse_out", ConstTensorView(lse_out)}}) {
    detail::check_view(v, 3, fn, name);
    check_dim(v, 0, B, fn, name, "B", "o1.shape[0]");
    check_dim(v, 1, H, fn, name, "H", "o1.shape[2]");
    check_dim(v, 2, T, fn, name, "T", "o1.shape[1]");
  }
  // out may be o1 itself (and lse_out lse1): each element is read before it is written.
  const ConstTensorView out_c = out, lse_out_c = lse_out;
  if (same_view(out_c, o1)) o1 = ConstTensorView{};
  if (same_view(lse_out_c, lse1)) lse1 = ConstTensorView{};
  detail::check_no_overlap(fn, {{"out", out_c}, {"lse_out", lse_out_c}},
                           {{"o1", o1}, {"lse1", lse1}, {"o2", o2}, {"lse2", lse2}});
  if (o1.data == nullptr) o1 = out_c;
  if (lse1.data == nullptr) lse1 = lse_out_c;

  if (B == 0 || H == 0 || T == 0) return;  // no rows (B may still be huge: do not loop over it)
  const auto* p1 = static_cast<const float*>(o1.data);
  const auto* p2 = static_cast<const float*>(o2.data);
  const auto* l1 = static_cast<const float*>(lse1.data);
  const auto* l2 = static_cast<const float*>(lse2.data);
  auto* po = static_cast<float*>(out.data);
  auto* lo = static_cast<float*>(lse_out.data);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t t = 0; t < T; ++t) {
        const float L1 = l1[b * lse1.strides[0] + h * lse1.strides[1] + t * lse1.strides[2]];
        const float L2 = l2[b * lse2.strides[0] + h * lse2.strides[1] + t * lse2.strides[2]];
        // NaN-propagating: a NaN L is not an empty part, it makes the row NaN (SPEC 4.3).
        const float m = kernels::max_nan(L1, L2);
        // L = log(e^{L¹} + e^{L²}) = m + log(e^{L¹−m} + e^{L²−m}); both parts empty → L = −∞, O =
        // 0.
        double w1 = 0.0, w2 = 0.0, L = -std::numeric_limits<double>::infinity();
        if (m != -std::numeric_limits<float>::infinity()) {
          w1 = std::exp(static_cast<double>(L1) - m);
          w2 = std::exp(static_cast<double>(L2) - m);
          L = m + std::log(w1 + w2);
          const double sum = w1 + w2;  // O = e^{L¹−L} O¹ + e^{L²−L} O²
          w1 /= sum;
          w2 /= sum;
        }
        if (D > 0) {  // with d_h = 0 the O views hold no element and may be null
          const float* r1 = p1 + b * o1.strides[0] + t * o1.strides[1] + h * o1.strides[2];
          const float* r2 = p2 + b * o2.strides[0] + t * o2.strides[1] + h * o2.strides[2];
          float* ro = po + b * out.strides[0] + t * out.strides[1] + h * out.strides[2];
          for (std::int64_t i = 0; i < D; ++i) {
            // An empty part (L = −∞) is not read; any other is weighted, even by an underflowed
            // 0 (0 · NaN = NaN: a NaN in its O is not hidden).
            constexpr float kEmpty = -std::numeric_limits<float>::infinity();
            const double a = L1 == kEmpty ? 0.0 : w1 * r1[i * o1.strides[3]];
            const double c = L2 == kEmpty ? 0.0 : w2 * r2[i * o2.strides[3]];
            ro[i * out.strides[3]] = static_cast<float>(a + c);
          }
        }
        lo[b * lse_out.strides[0] + h * lse_out.strides[1] + t * lse_out.strides[2]] =
            static_cast<float>(L);
      }
}

}  // namespace tokenmix
