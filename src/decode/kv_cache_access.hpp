// src/decode/kv_cache_access.hpp — internal read access to a KVCache for the decode entry point,
// and the cache's tile layout (kernels/kv_tile_layout.hpp), built in one place for the writer
// (src/decode/kv_cache.cpp) and the readers (src/decode/decode.cpp → the decode kernels).
#pragma once

#include <cstdint>

#include "kernels/kv_element.hpp"
#include "kernels/kv_tile_layout.hpp"
#include "tokenmix/kv_cache.hpp"

namespace tokenmix::detail {

static_assert(KVCache::kKeyTile == kernels::KVTileLayout::kKeyTile,
              "the public KVCache::kKeyTile must be the tile of the layout the kernels read");

struct KVCacheAccess {
  static kernels::KVTileLayout layout(const KVCache& x) {
    return {x.config_.heads_kv,
            x.config_.head_dim,
            x.block_tokens_,
            x.pool_blocks_,
            kernels::is_quantized(x.config_.dtype) ? kernels::KVTileLayout::kScaleBytes : 0,
            x.int8_quads_};
  }
  static const std::byte* layer(const KVCache& x, std::int64_t layer) {
    return x.storage_.data() + static_cast<std::size_t>(layer * layout(x).layer_elems()) * x.elem_;
  }
  static const std::int32_t* table(const KVCache& x, std::int64_t seq) {
    return x.table_.data() + seq * x.table_width_;
  }
  static std::int64_t table_width(const KVCache& x) { return x.table_width_; }
  static const std::int64_t* lengths(const KVCache& x, std::int64_t layer) {
    return x.lengths_.data() + layer * x.config_.batch;
  }
  /// Throws what KVCache::append (named `fn`) would for appending T_new positions to sequences
  /// [first_seq, first_seq + seqs) of `layer` (released sequence, capacity, overflow, pool).
  static void check_growth(const KVCache& x, const char* fn, std::int64_t layer,
                           std::int64_t first_seq, std::int64_t seqs, std::int64_t tnew) {
    x.check_growth(fn, layer, first_seq, seqs, tnew);
  }
  /// Quantized caches: throws what KVCache::append (named `fn`) would for a NaN or ±∞ in k or v.
  static void check_finite_rows(const KVCache& x, const char* fn, const ConstTensorView& k,
                                const ConstTensorView& v) {
    x.check_finite_rows(fn, k, v);
  }
  /// Rolling cache: slots per sequence R (position p lives in slot p mod R); 0 otherwise.
  static std::int64_t ring(const KVCache& x) { return x.ring_; }
};

}  // namespace tokenmix::detail
