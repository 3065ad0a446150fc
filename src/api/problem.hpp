// src/api/problem.hpp — the problem of an attention entry point from its q, k (and v) views:
// shapes checked against each other (SPEC "Names and shapes", 4.8), the options' scale, threads
// and score variants validated (variants.hpp), and the row log-sum-exp's shape. Shared by the
// forward and backward (attention.cpp) and the attention weights (weights.cpp).
#pragma once

#include "api/variants.hpp"
#include "kernels/attention_kernels.hpp"
#include "tokenmix/attention.hpp"
#include "tokenmix/tensor.hpp"

namespace tokenmix::detail {

/// Checks q [B,T_q,H_q,d_h], k [B,T_k,H_kv,d_h] and, unless v is null (attention_weights reads
/// no values), *v [B,T_k,H_kv,d_h] against each other and returns the problem. The score
/// variants of `o` are validated and normalised into p.var, pointing into `data`.
kernels::AttentionProblem make_problem(const char* fn, const ConstTensorView& q,
                                       const ConstTensorView& k, const ConstTensorView* v,
                                       const AttentionOptions& o, VariantData& data);

/// Checks that `lse` (named `name`) is a rank-3 f32 view [B, H_q, T_q] of the problem.
void check_lse(const char* fn, const ConstTensorView& lse, const char* name,
               const kernels::AttentionProblem& p);

}  // namespace tokenmix::detail
