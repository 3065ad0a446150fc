// src/api/dropout.cpp — attention_dropout_mask: the keep mask Z of options.dropout (docs/design.md
// "Attention dropout", D.2–D.3; kernels/dropout.hpp), written for every (b, h, t, u) of a call's
// sizes. The kernels draw the same Z element by element where a weight is visible; this is the
// mask for tests, for the float64 oracle and for users who want to see or reuse it.
#include "kernels/dropout.hpp"

#include <omp.h>

#include <cstdint>
#include <string>

#include "api/variants.hpp"
#include "kernels/kernel_skeleton.hpp"
#include "tokenmix/attention.hpp"
#include "tokenmix/error.hpp"
#include "tokenmix/runtime.hpp"
#include "util/validate.hpp"

namespace tokenmix {

void attention_dropout_mask(TensorView keep, const AttentionOptions& options) {
  constexpr const char* fn = "attention_dropout_mask";
  if (keep.rank != 4) {
    detail::fail(ErrorCode::shape_mismatch, fn,
                 "keep must have rank 4 [B, H_q, T_q, T_k]; got rank " + std::to_string(keep.rank));
  }
  if (keep.dtype != DType::boolean) {
    throw UnsupportedError(std::string(fn) + ": keep has dtype " + to_string(keep.dtype) +
                           "; expected bool (1 = kept)");
  }
  detail::check_view_extent(keep, fn, "keep");
  detail::check_no_overlap(fn, {{"keep", keep}}, {});
  if (options.threads < 0) {
    detail::fail(ErrorCode::invalid_argument, fn,
                 "options.threads must be >= 0 (0 = all); got " + std::to_string(options.threads));
  }
  const std::int64_t B = keep.dim(0), H = keep.dim(1), T_q = keep.dim(2), T_k = keep.dim(3);
  const kernels::Dropout z = detail::checked_dropout(fn, options.dropout, B, H, T_q, T_k);
  auto* out = static_cast<std::uint8_t*>(keep.data);
  const std::int64_t rows = B * H * T_q;  // (fits: the view's extent was checked)
  const int threads =
      kernels::threads_for_work(options.threads == 0 ? default_threads() : options.threads,
                                static_cast<double>(rows) * static_cast<double>(T_k) * 64.0);
#pragma omp parallel for schedule(static) num_threads(kernels::team_size(threads, rows))
  for (std::int64_t row = 0; row < rows; ++row) {
    const std::int64_t t = row % T_q, h = row / T_q % H, b = row / (T_q * H);
    std::uint8_t* r = out + b * keep.stride(0) + h * keep.stride(1) + t * keep.stride(2);
    for (std::int64_t u = 0; u < T_k; ++u) r[u * keep.stride(3)] = z.keep(b, h, t, u) ? 1 : 0;
  }
}

}  // namespace tokenmix
