// src/api/short_query.hpp — attention_forward's split-KV path for short query blocks
// (short_query.cpp): the decode kernels on plain strided K/V.
#pragma once

#include <cstdint>

#include "kernels/attention_kernels.hpp"
#include "tokenmix/runtime.hpp"
#include "tokenmix/tensor.hpp"

namespace tokenmix::detail {

/// Query blocks of at most this many positions take the split-KV path (short_query_applies).
inline constexpr std::int64_t kShortQuery = 16;

/// True when attention_forward's validated problem `p` (dtype, resolved path `isa`) runs on the
/// split-KV path: 1 ≤ T_q ≤ kShortQuery, T_k ≥ 1, no explicit mask or key lengths, an
/// alignment the decode layout expresses and a packed K/V copy of at most 64 MiB
/// (short_query.cpp). Depends on the shape and options
/// only, never on the thread count.
bool short_query_applies(const kernels::AttentionProblem& p, Isa isa, DType dtype);

/// Computes out (and lse unless empty) of the forward call `args` (args.p.site names the entry
/// point and its forward kernel, for ResourceError) on the split-KV path: K/V packed into the
/// decode tile layout, the decode kernel of `isa` and args.dtype on (b, KV head, query block,
/// 256-key chunk) units, the chunks merged in order (merge_decode_group).
void short_query_forward(const kernels::ForwardArgs& args, Isa isa, const TensorView& out,
                         const TensorView& lse);

}  // namespace tokenmix::detail
