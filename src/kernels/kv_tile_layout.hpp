// src/kernels/kv_tile_layout.hpp — where each K and V element of a KVCache lives: the one
// description of the cache's tile layout, used by its writer (KVCache::append / truncate,
// src/decode/kv_cache.cpp) and its readers (the decode kernels, via DecodeArgs).
//
// Per layer, the storage is [pool_blocks][H_kv][block_tokens / kKeyTile][K tile, V tile]:
//   K tile [d_h][kKeyTile]   the kKeyTile keys of a feature are contiguous (SIMD lanes)
//   V tile [kKeyTile][d_h]   rows
// so one (block, KV head) is a single forward stream of alternating K and V tiles. All offsets
// are in elements (multiply by the element size for bytes).
//
// Quantized caches (int8, fp8 E4M3: one-byte elements, so elements = bytes; SPEC "Reduced
// precision → Quantized KV cache") follow each K tile with the fp32 scales δ_{τ,e} of its d_h
// channels (K is quantized per channel over the closed 64-position tile τ) and each V tile with
// the fp32 scales of its kKeyTile rows (V per row):
//   K tile [d_h][kKeyTile] bytes, K channel scales [d_h] f32 (padded to a multiple of 64 bytes),
//   V tile [kKeyTile][d_h] bytes, V row scales [kKeyTile] f32
// (64 · d_h is a multiple of 64, so every tile and scale block starts 64-byte aligned), and a
// decode unit still reads one forward stream, scales next to the tile they scale
// (docs/performance.md, D-kv-1). The tile still being filled (the open tile) lives
// outside the stream, unquantized: KVCache's staging region (one fp32 [d_h][kKeyTile] K tile per
// (layer, sequence, KV head), after the layers), quantized into its slot when it closes.
// int8 tiles (int8_quads) hold the same bytes in VNNI-4 quads (four consecutive elements of the
// products' reduction dimension in one 32-bit word), the operand layout of AMX-INT8's B tiles:
//   K tile [d_h / 4][kKeyTile][4]: features 4i .. 4i + 3 of a key in one word (d_h % 4 tail
//          features after them as [d_h % 4][kKeyTile] rows, the plain layout's rows x),
//   V tile [kKeyTile / 4][d_h][4]: keys 4i .. 4i + 3 of a feature in one word,
// same sizes. The tile products load them as they are (no per-tile rewrite), and the FMA products
// read a 64-byte row of words as 16 columns × 4 k (one byte shuffle per 16 elements moves element
// j of each word to its top byte: q · 2^24, then the conversion: microkernel-inl.h int8_quad_t).
#pragma once

#include <cstdint>

namespace tokenmix::kernels {

struct KVTileLayout {
  /// Positions per tile: K is stored transposed in tiles of this many keys.
  static constexpr std::int64_t kKeyTile = 64;

  std::int64_t heads_kv = 0, head_dim = 0;
  std::int64_t block_tokens = 0;  // positions per block, a multiple of kKeyTile
  std::int64_t pool_blocks = 0;   // physical blocks per layer
  /// Quantized caches: elements (= bytes) of the fp32 scales after each K tile (d_h channel
  /// scales, padded to 64 bytes) and after each V tile (kKeyTile row scales); else 0.
  std::int64_t k_scale_elems = 0, v_scale_elems = 0;
  /// int8 caches: K and V tiles in VNNI-4 quads (see above).
  bool int8_quads = false;

  /// Bytes of the fp32 row scales following each V tile of a quantized cache.
  static constexpr std::int64_t kValueScaleBytes = 4 * kKeyTile;
  /// Bytes of the fp32 channel scales following each K tile of a quantized cache of width d_h.
  static constexpr std::int64_t key_scale_bytes(std::int64_t d_h) {
    return (4 * d_h + 63) / 64 * 64;
  }

  /// Elements of one K (or V) tile.
  std::int64_t tile_elems() const { return kKeyTile * head_dim; }
  /// Elements from a K tile's start to its V tile's (the K tile plus its channel scales), and
  /// from a V tile's start to the next K tile's (the V tile plus its row scales).
  std::int64_t k_span() const { return tile_elems() + k_scale_elems; }
  std::int64_t v_span() const { return tile_elems() + v_scale_elems; }
  /// Elements of one K / V tile pair (64 positions of one KV head, scales included).
  std::int64_t pair_span() const { return k_span() + v_span(); }
  /// Elements of one (block, KV head): its K and V tiles (and scales), block_tokens positions.
  std::int64_t head_block_elems() const { return (block_tokens / kKeyTile) * pair_span(); }
  /// Elements of one layer.
  std::int64_t layer_elems() const { return pool_blocks * heads_kv * head_block_elems(); }

  /// Offset, from the layer's start, of the K tile holding position `pos` (of the block, any
  /// position of the tile) of physical block `block`, KV head `head`. Its V tile starts
  /// k_span() later (v_tile); a quantized tile's scales start tile_elems() after the tile
  /// (scales_of).
  std::int64_t k_tile(std::int64_t block, std::int64_t head, std::int64_t pos) const {
    return (block * heads_kv + head) * head_block_elems() + pos / kKeyTile * pair_span();
  }
  std::int64_t v_tile(std::int64_t block, std::int64_t head, std::int64_t pos) const {
    return k_tile(block, head, pos) + k_span();
  }
  /// Quantized caches: offset of the fp32 scales of the tile at offset `tile`: a K tile's [d_h]
  /// channel scales (channel e's is element e), a V tile's [kKeyTile] row scales (row
  /// pos % kKeyTile's is element pos % kKeyTile).
  std::int64_t scales_of(std::int64_t tile) const { return tile + tile_elems(); }
  /// Offsets of feature x of position `pos` inside its K tile (keys in lanes) and V tile (rows);
  /// int8_quads: in their quads (K's d_h % 4 tail features in plain rows).
  std::int64_t key_in_tile(std::int64_t pos, std::int64_t x) const {
    const std::int64_t u = pos % kKeyTile;
    if (int8_quads && x < quad_features()) return x / 4 * 4 * kKeyTile + u * 4 + x % 4;
    return x * kKeyTile + u;
  }
  std::int64_t value_in_tile(std::int64_t pos, std::int64_t x) const {
    const std::int64_t u = pos % kKeyTile;
    if (int8_quads) return u / 4 * 4 * head_dim + x * 4 + u % 4;
    return u * head_dim + x;
  }
  /// int8_quads: K's features held in quads (d_h rounded down to a multiple of 4).
  std::int64_t quad_features() const { return head_dim / 4 * 4; }
};

}  // namespace tokenmix::kernels
