// src/api/variants.hpp — the score variants of the attention entry points (SPEC "Score variants
// used by real models"): validation of AttentionOptions' variant fields, their conversion into
// the kernels' ScoreVariants (kernels/attention_kernels.hpp), and the sinks' gradient, which the
// API computes once for every kernel path.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

#include "kernels/attention_kernels.hpp"
#include "tokenmix/attention.hpp"
#include "tokenmix/tensor.hpp"
#include "util/validate.hpp"

namespace tokenmix::detail {

/// What ScoreVariants points into during one call: contiguous copies of the slopes, sinks and
/// key lengths, and the row intervals of a boolean mask. Lives as long as the call.
struct VariantData {
  std::vector<float> alibi, sinks;
  std::vector<std::int64_t> key_lengths, row_begin, row_end;
  std::string names;  ///< the variants used, "window, softcap, ..." (empty: none)
};

/// Checks options.scale (finite, also in float32), options.threads (>= 0) and options.align;
/// returns the scale s of (4.2) for head width d_h.
float checked_scale(const char* fn, const AttentionOptions& o, std::int64_t dh);

/// A view as the kernels' Strided<const float*> / Strided<float*> (element strides 0–3).
template <class V>
auto strided(const V& v) {
  using Ptr =
      std::conditional_t<std::is_same_v<decltype(v.data), const void*>, const float*, float*>;
  return kernels::Strided<Ptr>{static_cast<Ptr>(v.data), v.strides[0], v.strides[1], v.strides[2],
                               v.strides[3]};
}

/// options.dropout validated for a call of the given sizes (p in [0, 1), offset < 2^32, the
/// Philox counter words of D.3 within 32 bits) as the kernels' Dropout; throws ArgumentError
/// naming `fn` and the field.
kernels::Dropout checked_dropout(const char* fn, const AttentionOptions::Dropout& d,
                                 std::int64_t batch, std::int64_t hq, std::int64_t tq,
                                 std::int64_t tk);

/// True when `o` uses any score variant (window, softcap, alibi_slopes, sinks, mask,
/// key_lengths) or dropout.
bool uses_variants(const AttentionOptions& o);

/// Validates the variant fields of `o` against the problem (p.batch, p.tq, p.tk, p.hq are set)
/// and fills p.var, pointing into `data`. Throws ArgumentError / UnsupportedError naming `fn`,
/// the argument, what was expected and what was given. A boolean mask whose every row is one
/// interval of true keys becomes row intervals only (no element-wise mask); otherwise the
/// intervals are the rows' hulls and the mask is also applied element-wise.
void prepare_variants(const char* fn, const AttentionOptions& o, kernels::AttentionProblem& p,
                      VariantData& data);

/// The f32 mask (an input the kernels read during the call) for the aliasing check, else empty.
ConstTensorView mask_if_f32(const AttentionOptions& o);

/// Throws ArgumentError(aliasing) if a boolean options.mask shares any byte with one of the
/// outputs (byte ranges; the element-exact check of check_no_overlap is for f32 views).
void check_bool_mask_disjoint(const char* fn, const AttentionOptions& o,
                              std::initializer_list<NamedView> outputs);

/// Validates dsinks: empty, or rank 1 [H_q] f32 — and then options.sinks must be set.
void check_dsinks(const char* fn, const AttentionOptions& o, const ConstTensorView& dsinks,
                  std::int64_t hq);

/// dσ_h = −Σ_{b,t} e^{σ_h − L_t} D_t with D_t = ⟨dO_t, O_t⟩ (SPEC "Score variants": sinks), in
/// double with a fixed order per head (independent of the thread count); written to dsinks[h].
/// out/dout are [B, T_q, H_q, d_h], lse [B, H_q, T_q] (Strided views); uses p.batch, p.tq, p.hq,
/// p.dh, p.var.sinks, p.threads. out/dout have element type `dtype` (f32, bf16, f16).
void sinks_gradient(const kernels::AttentionProblem& p, DType dtype, const kernels::In& out,
                    const kernels::In& dout, const kernels::In& lse, const TensorView& dsinks);

}  // namespace tokenmix::detail
