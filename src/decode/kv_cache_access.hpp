// src/decode/kv_cache_access.hpp — internal read access to a KVCache for the decode entry point,
// and the cache's tile layout (kernels/kv_tile_layout.hpp), built in one place for the writer
// (src/decode/kv_cache.cpp) and the readers (src/decode/decode.cpp → the decode kernels).
#pragma once

#include <cstdint>
#include <cstring>

#include "kernels/kv_element.hpp"
#include "kernels/kv_tile_layout.hpp"
#include "tokenmix/kv_cache.hpp"

namespace tokenmix::detail {

static_assert(KVCache::kKeyTile == kernels::KVTileLayout::kKeyTile,
              "the public KVCache::kKeyTile must be the tile of the layout the kernels read");

struct KVCacheAccess {
  static kernels::KVTileLayout layout(const KVCache& x) {
    const bool quantized = kernels::is_quantized(x.config_.dtype);
    return {x.config_.heads_kv,
            x.config_.head_dim,
            x.block_tokens_,
            x.pool_blocks_,
            quantized ? kernels::KVTileLayout::key_scale_bytes(x.config_.head_dim) : 0,
            quantized ? kernels::KVTileLayout::kValueScaleBytes : 0,
            x.int8_quads_};
  }
  /// Quantized caches: the open K tiles of `layer` (SPEC "Quantized KV cache": the tile still
  /// being filled, unquantized), fp32 [B][H_kv][d_h][kKeyTile] (keys in lanes, as a K tile);
  /// null for other dtypes.
  static const float* open_tiles(const KVCache& x, std::int64_t layer) {
    if (!kernels::is_quantized(x.config_.dtype)) return nullptr;
    return reinterpret_cast<const float*>(x.storage_.data() + x.staging_offset(layer, 0, 0));
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
  /// The values the cache holds for the K (value = false) or V row of (layer, seq, pos, head),
  /// d_h of them into out: the stored f32 / bf16 / f16 elements widened; quantized (SPEC
  /// "Quantized KV cache"): V c · δ_u, K of a closed tile c_e · δ_{τ,e}, K of the open tile its
  /// staged fp32 values (each exact in float64). pos must be held (first_position ≤ pos <
  /// length). For the bench's error against the float64 oracle.
  static void cached_row(const KVCache& x, std::int64_t layer, std::int64_t seq, std::int64_t pos,
                         std::int64_t head, bool value, double* out) {
    const kernels::KVTileLayout L = layout(x);
    const std::int64_t s = x.ring_ != 0 ? pos % x.ring_ : pos, D = x.config_.head_dim;
    const std::int64_t blk = table(x, seq)[s / L.block_tokens], off = s % L.block_tokens;
    const std::int64_t tile = value ? L.v_tile(blk, head, off) : L.k_tile(blk, head, off);
    const std::byte* base =
        x.storage_.data() + static_cast<std::size_t>(layer * L.layer_elems()) * x.elem_;
    const DType dt = x.config_.dtype;
    const std::int64_t len = x.length(seq, layer), t = KVCache::kKeyTile;
    if (!value && kernels::is_quantized(dt) && len % t != 0 && pos >= len / t * t) {
      const float* open = open_tiles(x, layer) + (seq * x.config_.heads_kv + head) * D * t;
      for (std::int64_t e = 0; e < D; ++e) out[e] = open[e * t + pos % t];
      return;
    }
    for (std::int64_t e = 0; e < D; ++e) {
      const double c = kernels::load_element(
          dt, base, tile + (value ? L.value_in_tile(off, e) : L.key_in_tile(off, e)));
      float delta = 1.0f;
      if (kernels::is_quantized(dt)) {
        std::memcpy(&delta, base + L.scales_of(tile) + (value ? off % t : e) * 4, sizeof delta);
      }
      out[e] = c * delta;
    }
  }
  /// Rolling cache: slots per sequence R (position p lives in slot p mod R); 0 otherwise.
  static std::int64_t ring(const KVCache& x) { return x.ring_; }
};

}  // namespace tokenmix::detail
