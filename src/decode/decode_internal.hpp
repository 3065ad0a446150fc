// src/decode/decode_internal.hpp — internal entry points of attention_decode
// (src/decode/decode.cpp) for the layer (src/model/layer.cpp) and the tests.
#pragma once

#include <cstdint>

#include "kernels/attention_kernels.hpp"
#include "tokenmix/kv_cache.hpp"
#include "tokenmix/tensor.hpp"

namespace tokenmix::detail {

/// Everything attention_decode(q, cache, layer, out, lse, options) would check, for the cache as
/// it will be once `pending` more positions are appended to each of the call's sequences, and the
/// scratch that call needs, reserved now in this thread (entry point `fn` in messages). The
/// layer calls it before it appends, so that the decode after the append cannot fail and a
/// failure leaves the cache unchanged (issue 11). Throws what attention_decode would
/// (ArgumentError, UnsupportedError, ResourceError).
void prepare_decode(const char* fn, ConstTensorView q, const KVCache& cache, std::int64_t layer,
                    TensorView out, TensorView lse, const DecodeOptions& options,
                    std::int64_t pending);

/// The merge of a decode-kernel run (kernels::DecodeArgs after the kernel wrote its partials):
/// for query group `grp` (b, KV head j, query block; grp = (b · H_kv + j) · qblocks + block), the
/// chunks of each row merged in chunk order (SPEC "Merging partial results"), the sink added,
/// O = Õ / l stored into `out` (dtype `act`, [B, T, H_q, d_h]) and L = m + log l into `lse`
/// ([B, H_q, T]; skipped when empty). `acc` is d_h floats of the calling thread's scratch. Used
/// by attention_decode and by attention_forward's short-query path (short_query.cpp).
void merge_decode_group(const kernels::DecodeArgs& a, std::int64_t grp, float* acc, DType act,
                        const TensorView& out, const TensorView& lse);

/// Test seam: while `bytes` ≥ 0, a decode call (or prepare_decode) whose scratch exceeds `bytes`
/// throws ResourceError(out_of_memory) exactly as a refused allocation does. −1 (the default)
/// removes the limit. Process-wide; for the tests only.
void set_decode_scratch_limit_for_testing(std::int64_t bytes);

}  // namespace tokenmix::detail
