// tokenmix/kv_cache.hpp — the key/value cache of autoregressive inference (SPEC 4.3, 4.8) and the
// decode attention that reads it.
//
// A KVCache holds, for n layers and B sequences, the post-RoPE keys K and values V of every
// cached position of every KV head: [n, B, T, H_kv, d_h] each, in fp32, bf16 or f16 (converted
// on write with round-to-nearest-even; read back and accumulated in fp32). Its storage is
// SPEC 4.8's figure, 2 · n · B · T_max · H_kv · d_h · sizeof(element) (kv_cache_bytes
// below), plus the block tables and lengths (memory_bytes() reports the total).
//
// Quantized caches (dtype int8 or fp8_e4m3, SPEC "Reduced precision → Quantized KV cache"):
// one-byte elements c with fp32 scales δ, δ = max|x| / 127 (int8: c = round(x / δ) ∈ [−127, 127],
// ties to even) or max|x| / 448 (fp8 E4M3: x / δ rounded to the nearest E4M3 value) over the values
// a scale covers; δ = 0 stores zeros. Attention reads x̂ = c · δ. V: one scale per row of one
// (position, KV head). K: one scale per channel over each closed tile of 64 positions (keys of
// real models carry a few channels 10–100× the others); the tile still being filled (the open
// tile, positions [64·⌊L / 64⌋, L)) is held unquantized in fp32 beside the tiles and quantized
// when its 64th key arrives, so what is stored does not depend on how appends were chunked. In
// storage each K tile is followed by its d_h channel scales (padded to 64 bytes) and each V tile
// by its 64 row scales; the open tiles take 256 · d_h bytes per (layer, sequence, KV head). A
// truncate into a closed tile reopens it: the keys it keeps are held as their values c · δ
// (rounded to fp32) and quantized again, with the tile's new channel scales, when it closes; a
// rolling cache's new positions wait in the open tile while the closed tile whose slots they
// reuse keeps serving its still-held keys (docs/design.md, "Quantized caches"). Rows holding NaN
// or ±∞ are rejected on append (no finite scale represents them): ArgumentError, nothing of the
// batch appended.
//
// Storage is in blocks of `block_tokens` positions. A block holds, per layer and KV head, tiles
// of 64 positions, a K tile and then its V tile, alternating:
//   K tile [d_h][64]   (the 64 keys of a feature are contiguous SIMD lanes)
//   V tile [64][d_h]   (rows)
// (int8: the same bytes in VNNI-4 quads, the operand layout of AMX-INT8's tile products: K
// [d_h/4][64][4], four features of a key to a 32-bit word, the d_h % 4 tail features after them
// as [d_h % 4][64]; V [16][d_h][4], four keys of a feature to a word)
// which is what the decode kernel reads (scores S = q Kᵀ with keys in lanes, then O += P V with
// features in lanes), in the order it reads them: one (sequence, KV head) is a single forward
// stream through memory, so nothing is repacked per step and the hardware prefetcher follows
// one stream per thread (separate K and V regions were 25 % slower per thread, docs/
// performance.md, D-decode-1). Two flavours share that layout and the kernels:
//   contiguous  one block of T_max (rounded up to 64) positions per sequence, fixed;
//   paged       a shared pool of fixed-size blocks; each sequence has a block table and takes
//               blocks as it grows; truncate / release / reset return blocks to the pool.
//
// Lengths are kept per (layer, sequence): prefill/step of layer l advances layer l's length, so
// a model appends layer by layer and every layer sees its own consistent length. RoPE positions
// of new tokens start at the sequence's current length.
//
// Rolling buffer (KVCacheConfig::window = W ≥ 1, for sliding-window layers, SPEC "Score
// variants": sliding window). Each sequence keeps only its most recent positions, in a ring of
// R = round_up(W + 64, block) slots (block = 64 contiguous, block_tokens paged): position p lives
// in slot p mod R, so memory is O(W) per sequence, independent of the length. R leaves at least
// one 64-position tile of slack beyond W, for truncation (speculative decoding) and for several
// new tokens per decode call. Positions keep counting: length(seq, layer) is the total number of
// positions appended (RoPE positions continue from it), first_position(seq, layer) the oldest
// one still held (max(0, length − R) after appends). Semantics:
//   append    writes positions length … length + T_new − 1; older positions fall out of the
//             ring (only the last R of a long append are written); capacity bounds the total
//             length, not the memory.
//   truncate  new_length must be 0 (empties the sequence) or ≥ first_position of every layer
//             it shortens (it can only go back within the retained positions); else ArgumentError.
//   decode    needs options.window ≤ W (a decode without a window, or with a larger one, is an
//             ArgumentError naming options.window), and the keys its T_new queries see —
//             positions from length − T_new − window + 1 on — must still be held (ArgumentError
//             naming T_new otherwise; at most R − window + 1 new tokens per call).
//
// Every mutating method validates all of its arguments before it changes anything: on a typed
// error (ArgumentError / UnsupportedError, error.hpp) the cache is unchanged, byte for byte.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tokenmix/attention.hpp"
#include "tokenmix/tensor.hpp"

namespace tokenmix {

/// Sizes and element type of a KVCache.
struct KVCacheConfig {
  std::int64_t layers = 0;    ///< n
  std::int64_t batch = 0;     ///< B (sequence slots)
  std::int64_t heads_kv = 0;  ///< H_kv
  std::int64_t head_dim = 0;  ///< d_h
  std::int64_t capacity = 0;  ///< T_max: most positions one sequence may hold
  /// Element type of K and V in the cache: f32, bf16, f16, or quantized int8 / fp8_e4m3.
  DType dtype = DType::f32;
  /// 0 = contiguous (one block of T_max rounded up to 64 per sequence). Otherwise paged: block
  /// size in positions, a positive multiple of KVCache::kKeyTile (64).
  std::int64_t block_tokens = 0;
  /// Paged only: blocks in the shared pool; 0 = enough for every sequence at T_max (with a
  /// window: at its ring of R positions).
  std::int64_t pool_blocks = 0;
  /// 0 = keep every position. W ≥ 1 = rolling buffer for a sliding-window layer: keep only the
  /// last R = round_up(W + 64, block) positions of each sequence (see the top of this file);
  /// capacity then bounds the total length only, and storage is O(W).
  std::int64_t window = 0;
  /// int8 only: the layout of the K and V tiles. true: VNNI-4 quads (four consecutive elements of
  /// a row, or of a feature, per 32-bit word), which AMX-INT8 multiplies as they are; false: plain
  /// rows, which the FMA paths widen one instruction cheaper per vector (AVX2 read quads at
  /// 1.26–1.28× the time of rows at T_new = 1 and 2 on AMD Zen 4). Unset: rows, on every CPU
  /// (the layout follows the config, never the CPU); on a CPU with AMX-INT8 ask for quads to get
  /// decode's tile products. Every path reads either; the results are the same bits. Setting it
  /// for another dtype is an ArgumentError.
  std::optional<bool> int8_quads = std::nullopt;
};

/// KV-cache bytes (SPEC 4.8): 2 · n_layers · B · T · H_kv · d_h · sizeof(element).
/// Throws ArgumentError(overflow) if the product does not fit in 64 bits. (A quantized int8 /
/// fp8_e4m3 cache holds more: its scales and open tiles, KVCache::storage_bytes.)
std::uint64_t kv_cache_bytes(std::int64_t n_layers, std::int64_t batch, std::int64_t tokens,
                             std::int64_t heads_kv, std::int64_t head_dim,
                             std::size_t element_bytes);

class KVCache;
namespace detail {
struct KVCacheAccess;  // read access for the decode kernels (src/decode/decode.cpp)
}

class KVCache {
 public:
  /// Positions per key tile: K is stored transposed in tiles of this many keys (SIMD lanes).
  /// Equal to the internal KVTileLayout::kKeyTile (static_assert in
  /// src/decode/kv_cache_access.hpp).
  static constexpr std::int64_t kKeyTile = 64;

  /// Validates the configuration (positive sizes, known dtype, block size a multiple of 64, no
  /// overflow) and allocates zeroed storage. Every sequence starts active with length 0.
  explicit KVCache(const KVCacheConfig& config);

  const KVCacheConfig& config() const noexcept { return config_; }
  bool paged() const noexcept { return config_.block_tokens != 0; }
  /// int8: the tiles hold VNNI-4 quads (KVCacheConfig::int8_quads, resolved); false otherwise.
  bool int8_quads() const noexcept { return int8_quads_; }
  /// Positions per block (T_max rounded up to 64 for a contiguous cache).
  std::int64_t block_tokens() const noexcept { return block_tokens_; }
  /// Blocks in the pool (B for a contiguous cache) and how many are not held by a sequence.
  std::int64_t pool_blocks() const noexcept { return pool_blocks_; }
  std::int64_t free_blocks() const noexcept { return static_cast<std::int64_t>(free_list_.size()); }

  /// Cached positions of sequence `seq` in layer `layer` (with a window: positions appended in
  /// total, of which the last retained_positions() at most are still held).
  std::int64_t length(std::int64_t seq, std::int64_t layer = 0) const;
  /// Oldest position of sequence `seq` in layer `layer` still held: 0 unless rolling.
  std::int64_t first_position(std::int64_t seq, std::int64_t layer = 0) const;
  /// Rolling cache: W (config.window); 0 otherwise.
  std::int64_t window() const noexcept { return config_.window; }
  /// Positions a sequence can hold at once: R for a rolling cache, T_max otherwise.
  std::int64_t retained_positions() const noexcept { return ring_ != 0 ? ring_ : config_.capacity; }
  /// False after release(seq) until reset(seq).
  bool active(std::int64_t seq) const;

  /// Appends T_new positions to sequences first_seq … first_seq + B' − 1 of layer `layer`:
  /// k, v are f32 [B', T_new, H_kv, d_h] views (any strides), already RoPE-rotated. Position
  /// length(seq, layer) + t receives k[b, t]. Throws (cache unchanged) on: bad layer or sequence
  /// range, released sequence, head count or width mismatch, non-f32 view, positions past
  /// capacity or overflowing, too few free blocks in the pool; on a quantized cache (int8,
  /// fp8_e4m3) also on any NaN or ±∞ element of k or v.
  void append(std::int64_t layer, std::int64_t first_seq, ConstTensorView k, ConstTensorView v);

  /// Rewinds sequence `seq` to at most `new_length` positions in every layer (speculative
  /// decoding: drop rejected tokens); layers already shorter keep their length. new_length must
  /// be in [0, longest layer length], and on a rolling cache 0 or ≥ first_position(seq, l) of
  /// every layer l it shortens. Dropped positions are zeroed (the storage then equals that of a
  /// cache that never held them) and blocks no longer needed return to the pool (rolling and
  /// paged: only once no layer of the sequence has wrapped around its ring). Quantized caches: a
  /// new_length inside a closed 64-position K tile reopens it; its kept keys keep their quantized
  /// values c · δ (in fp32) in the open tile until it closes again and is re-quantized with new
  /// channel scales (then not bit for bit a cache that never held the dropped positions).
  void truncate(std::int64_t seq, std::int64_t new_length);
  /// Sequence b of this cache becomes a copy of sequence sources[b] of `source`, for every b in
  /// [0, batch): its positions, lengths and first positions in every layer (the stored bytes,
  /// no re-quantization), and it is active. A source may be named several times or not at all.
  /// This is beam search's reordering (source = *this: copied through a temporary snapshot)
  /// and a change of batch (transformers' batch_repeat_interleave / batch_select_indices: a new
  /// cache of the new batch copies from the old one). Requirements (ArgumentError naming the
  /// argument otherwise, this cache unchanged): sources.size() == batch; each sources[b] in
  /// [0, source batch) and active in `source`; `source` has the same layers, heads_kv,
  /// head_dim, dtype, window, int8 layout and block_tokens(); every copied length fits this
  /// cache's capacity; paged: the pool holds every copied block (all of this cache's blocks are
  /// given back first). Blocks no sequence holds afterwards are zeroed, so storage equals that
  /// of a cache that was appended the copied positions.
  void copy_sequences(const KVCache& source, std::span<const std::int64_t> sources);
  /// Marks `seq` finished: its blocks return to the pool; reading or appending it throws until
  /// reset(seq).
  void release(std::int64_t seq);
  /// Empties (and reactivates) sequence `seq`.
  void reset(std::int64_t seq);
  /// Empties every sequence.
  void reset();

  /// Bytes of K/V storage (SPEC 4.8): contiguous 2 · n · B · T · H_kv · d_h · sizeof(element)
  /// with T = T_max rounded up to 64 (= kv_cache_bytes(n, B, T, …)); paged the same with
  /// B · T replaced by pool_blocks · block_tokens. Quantized caches: per 64 positions of a KV
  /// head 128 · d_h bytes of elements, the K tile's d_h fp32 channel scales (rounded up to a
  /// multiple of 64 bytes) and the V tile's 64 fp32 row scales; plus the open K tiles in fp32,
  /// n · B · H_kv · 256 · d_h bytes.
  std::uint64_t storage_bytes() const noexcept {
    return static_cast<std::uint64_t>(storage_.size());
  }
  /// All memory the cache holds: storage plus block tables, lengths and bookkeeping.
  std::uint64_t memory_bytes() const noexcept;

  /// Raw K/V storage (tests compare it before and after a failing call).
  std::span<const std::byte> raw_storage() const noexcept { return storage_; }

 private:
  friend struct detail::KVCacheAccess;

  void check_seq(const char* fn, std::int64_t seq) const;
  void check_layer(const char* fn, std::int64_t layer) const;
  void check_finite_rows(const char* fn, const ConstTensorView& k, const ConstTensorView& v) const;
  std::int64_t blocks_needed(std::int64_t tokens) const noexcept;
  std::int64_t max_length(std::int64_t seq) const noexcept;
  void shrink(std::int64_t seq, std::int64_t new_length);
  void shrink_open_tiles(std::int64_t layer, std::int64_t seq, std::int64_t new_length,
                         std::int64_t lo, std::int64_t len);
  void check_growth(const char* fn, std::int64_t layer, std::int64_t first_seq, std::int64_t seqs,
                    std::int64_t tnew) const;
  /// Slot of position `pos` (pos mod R for a rolling cache).
  std::int64_t slot(std::int64_t pos) const noexcept { return ring_ != 0 ? pos % ring_ : pos; }
  /// Rolling and paged: the ring blocks that positions [from, to) of `seq` need and that the
  /// sequence does not hold yet (each once), appended to `out`.
  void missing_ring_blocks(std::int64_t seq, std::int64_t from, std::int64_t to,
                           std::vector<std::int64_t>& out) const;

  /// Quantized caches: byte offset in storage_ of the open K tile (fp32 [d_h][64], SPEC
  /// "Quantized KV cache": the tile being filled, unquantized) of (layer, seq, head).
  std::int64_t staging_offset(std::int64_t layer, std::int64_t seq,
                              std::int64_t head) const noexcept {
    return staging_begin_ + ((layer * config_.batch + seq) * config_.heads_kv + head) * 4 *
                                kKeyTile * config_.head_dim;
  }
  /// Quantized caches: the open tile of (layer, seq, head) closes: its 64 staged keys are
  /// quantized per channel into the K tile at slot `pos` (any position of the tile) of block
  /// `blk`, the channel scales after it, and the staging tile is zeroed.
  void close_tile(std::int64_t layer, std::int64_t seq, std::int64_t head, std::int64_t blk,
                  std::int64_t pos);

  KVCacheConfig config_;
  std::int64_t staging_begin_ = 0;  // quantized: bytes of the tiles, where the open tiles start
  std::int64_t block_tokens_ = 0, pool_blocks_ = 0, table_width_ = 0;
  std::int64_t ring_ = 0;    // rolling: slots per sequence R (a multiple of block_tokens_); 0 = off
  std::size_t elem_ = 4;     // bytes per element
  bool int8_quads_ = false;  // int8 tiles in VNNI-4 quads (KVCacheConfig::int8_quads)
  // [n][pool_blocks][H_kv][block_tokens / 64][K tile, V tile]: kernels::KVTileLayout
  // (src/kernels/kv_tile_layout.hpp) is the one description, for writer and readers.
  std::vector<std::byte> storage_;
  std::vector<std::int32_t> table_;  // [B][table_width]: physical block of logical block i, or −1
  std::vector<std::int64_t> lengths_;    // [n][B]
  std::vector<std::int64_t> firsts_;     // [n][B] first_position (rolling; 0 otherwise)
  std::vector<std::uint8_t> active_;     // [B]
  std::vector<std::int32_t> free_list_;  // free physical blocks (paged), popped from the back
};

/// The KV-cache element type named `text`: f32, bf16, f16, int8 or fp8_e4m3 (ArgumentError
/// naming `what` otherwise).
DType parse_cache_dtype(const std::string& text, const char* what = "cache_dtype");

/// Options of attention_decode. Decoding is always causal, bottom-right aligned (SPEC 4.3):
/// query t of sequence b (length L_b) is at position p = L_b − T_new + t. The score variants
/// have the meaning and validation of AttentionOptions' (SPEC "Score variants used by real
/// models"): S = cap(z) + b_h(p, u) over the visible keys, sinks in the denominator.
struct DecodeOptions {
  std::optional<double> scale;  ///< s in (4.2); default 1/sqrt(d_h). Must be finite.
  int threads = 0;              ///< 0 = all; results are bitwise identical for any count
  Isa isa = Isa::automatic;     ///< force a kernel path, as for attention_forward
  std::int64_t first_seq = 0;   ///< q's batch row b is cache sequence first_seq + b
  /// Sliding window W ≥ 1: key u is visible only if p − W < u. Only the last W (+ T_new − 1)
  /// positions of each sequence are read. Required (≤ the cache's window) on a rolling cache.
  std::optional<std::int64_t> window;
  /// Logit soft-capping c > 0 (finite, positive in float32): cap(z) = c·tanh(z / c).
  std::optional<double> softcap;
  /// ALiBi slopes, rank 1 [H_q] f32 (any stride): b_h = −m_h·(p − u). Empty = off. As for
  /// attention_forward, values are data (NaN and ±∞ propagate, SPEC 4.3).
  ConstTensorView alibi_slopes;
  /// Attention sinks, rank 1 [H_q] f32 (any stride; values are data): σ_h joins each row's softmax
  /// denominator, L = log(e^{σ_h} + Σ_u e^{S_u}); a row that sees no key gives O = 0, L = σ_h.
  ConstTensorView sinks;
};

/// Attention of T_new new queries per sequence against the cached keys/values of layer `layer`.
///   q   [B', T_new, H_q, d_h] f32, bf16 or f16 (on any cache dtype), any strides; H_q a
///       multiple of the cache's H_kv
///   out [B', T_new, H_q, d_h], the dtype of q (bf16/f16: rounded once, nearest even; the
///       arithmetic is fp32, SPEC "Reduced precision");  lse [B', H_q, T_new] f32 or empty
/// The new queries are the last T_new positions of each sequence (their K/V already appended):
/// query t of sequence b (length L_b) sees keys u ≤ L_b − T_new + t (bottom-right, SPEC 4.3);
/// sequences may have different lengths. All g = H_q / H_kv query heads of a KV head are served
/// by one pass over that head's K/V. Keys are split into fixed chunks (flash-decoding) whose
/// partial results are merged in a fixed order (SPEC "Merging partial results"; sinks join the
/// merged denominator), so the result does not depend on the thread count. A row that sees no
/// key gives O = 0, L = −∞ (L = σ_h with sinks). Options: see DecodeOptions; with a window, key
/// tiles before the first query's window are not read.
void attention_decode(ConstTensorView q, const KVCache& cache, std::int64_t layer, TensorView out,
                      TensorView lse = {}, const DecodeOptions& options = {});

/// Bytes of K and V one attention_decode call reads (SPEC "Useful-work counts", decode bytes):
/// 2 · Σ_b n_b · H_kv · d_h · sizeof(element) over the sequences of the call (quantized caches,
/// what is read: per KV head n_b · (d_h + 4) bytes of V, d_h bytes of K per key of a closed tile
/// plus each such tile's channel scales, 4 · d_h bytes per key of the open tile), with n_b the keys
/// of sequence b the call's T_new queries can see: L_b − first_position(b) without a window
/// (window = 0), min of that and window + T_new − 1 with one.
std::uint64_t decode_bytes(const KVCache& cache, std::int64_t layer, std::int64_t first_seq,
                           std::int64_t batch, std::int64_t window = 0, std::int64_t tnew = 1);

}  // namespace tokenmix
