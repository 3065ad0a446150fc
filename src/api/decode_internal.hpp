// src/api/decode_internal.hpp — internal entry points of attention_decode (src/api/decode.cpp)
// for the layer (src/model/layer.cpp) and the tests.
#pragma once

#include <cstdint>

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

/// Test seam: while `bytes` ≥ 0, a decode call (or prepare_decode) whose scratch exceeds `bytes`
/// throws ResourceError(out_of_memory) exactly as a refused allocation does. −1 (the default)
/// removes the limit. Process-wide; for the tests only.
void set_decode_scratch_limit_for_testing(std::int64_t bytes);

}  // namespace tokenmix::detail
