// src/kernels/attention_kernels.hpp — the internal interface between the public API (which
// validates and dispatches) and the kernels (which compute). Everything here is already
// checked: shapes agree, pointers are valid, sizes fit, outputs do not alias inputs.
//
// Which kernel runs for which ISA and dtype is decided in one place, the registry
// (dispatch/registry.cpp); this header only declares the kernels it lists.
#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "kernels/dropout.hpp"
#include "kernels/kv_element.hpp"
#include "kernels/kv_tile_layout.hpp"
#include "kernels/scratch_arena.hpp"
#include "tokenmix/attention.hpp"
#include "tokenmix/error.hpp"
#include "tokenmix/tensor.hpp"

namespace tokenmix::kernels {

/// A tensor of logical shape [B, T, H, d_h] (or [B, H, T] for LSE) with element strides.
template <class Pointer>
struct Strided {
  Pointer data = nullptr;
  std::int64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  Pointer row(std::int64_t i0, std::int64_t i1, std::int64_t i2) const {
    return data + i0 * s0 + i1 * s1 + i2 * s2;
  }
};
/// The activation views of ForwardArgs/BackwardArgs. Their element type is the call's dtype
/// (ForwardArgs::dtype: f32, bf16 or f16; SPEC "Reduced precision"); the pointer is typed
/// `float` and holds the tensor's address. A kernel of another dtype re-types the view with
/// as<T>() before any indexing (strides count elements of the dtype); nothing may index a
/// bf16/f16 view as float. LSE views are always f32.
using In = Strided<const float*>;
using Out = Strided<float*>;

/// The view `x` re-typed to its true element type T (float, bf16_t, f16_t; kv_element.hpp).
template <class T>
Strided<const T*> as(const In& x) {
  return {reinterpret_cast<const T*>(x.data), x.s0, x.s1, x.s2, x.s3};
}
template <class T>
Strided<T*> as(const Out& x) {
  return {reinterpret_cast<T*>(x.data), x.s0, x.s1, x.s2, x.s3};
}

/// How an explicit mask enters the scores (SPEC "Score variants": explicit masks).
enum class MaskKind : std::uint8_t {
  none,     ///< no per-element mask
  boolean,  ///< one byte per element, nonzero = may attend (0 selects −∞: the key takes no part)
  bias,     ///< f32, added to the score
};

/// The score variants of one call (SPEC "Score variants used by real models"), as the kernels see
/// them: validated and normalised by the API (src/api). Two mechanisms, shared by every kernel:
///  * key ranges: each row (b, h, t) sees one interval of keys [begin, end) (AttentionProblem::
///    key_range): the causal mask, the window, the key length of sequence b and an interval-
///    shaped boolean mask (the API's fast path) only move the interval's ends, so the kernels
///    skip every key tile outside it and mask only tiles crossing an end;
///  * element-wise terms on the scores of the visited tiles (elementwise()): soft-capping, ALiBi,
///    a general mask (bias added or boolean selected); AttentionProblem::score is the scalar form.
/// Sinks enter the online softmax's initial state (m = σ_h, l = 1, Õ = 0), so L includes e^{σ_h}.
struct ScoreVariants {
  std::int64_t window = 0;                    ///< W ≥ 1; 0 = no window
  float softcap = 0.0f;                       ///< c > 0; 0 = no capping
  const float* alibi = nullptr;               ///< [H_q] slopes m_h, contiguous; null = off
  const float* sinks = nullptr;               ///< [H_q] σ_h, contiguous; null = off
  const std::int64_t* key_lengths = nullptr;  ///< [B]; keys u ≥ key_lengths[b] invisible
  /// Row intervals of an interval-shaped boolean mask: row (b, h, t) sees keys
  /// [row_begin[i], row_end[i]) with i = b·r0 + h·r1 + t·r2 (stride 0 broadcasts); null = none.
  const std::int64_t* row_begin = nullptr;
  const std::int64_t* row_end = nullptr;
  std::int64_t r0 = 0, r1 = 0, r2 = 0;
  /// A general mask, element (b, h, t, u) at mask[b·m0 + h·m1 + t·m2 + u·m3] (stride 0
  /// broadcasts): std::uint8_t for boolean, float for bias.
  MaskKind mask_kind = MaskKind::none;
  const void* mask = nullptr;
  std::int64_t m0 = 0, m1 = 0, m2 = 0, m3 = 0;
  /// Attention dropout (dropout.hpp, D.1–D.4): after the softmax, P̃ = P ⊙ Z / (1 − p) weighs
  /// the values; l and L stay those of P. Forward and backward only (decode refuses it).
  Dropout dropout;

  /// True when the scores of visited tiles need an element-wise pass (cap, ALiBi, mask).
  bool elementwise() const {
    return softcap > 0.0f || alibi != nullptr || mask_kind != MaskKind::none;
  }
  /// The scalar form of the cap and ALiBi terms, for z = s·⟨q, k_u⟩ of query head h at distance
  /// p − u from its position p: cap(z) − m_h·(p − u). AttentionProblem::score and
  /// DecodeArgs::score (each with its own p) are this one formula.
  float cap_alibi(float z, std::int64_t h, std::int64_t p_minus_u) const {
    float x = softcap > 0.0f ? softcap * std::tanh(z / softcap) : z;
    if (alibi != nullptr) x -= alibi[h] * static_cast<float>(p_minus_u);
    return x;
  }
};

/// The keys one row sees: [begin, end); empty when end ≤ begin.
struct KeyRange {
  std::int64_t begin = 0, end = 0;
};

/// One attention problem (SPEC 4.2–4.5, 4.8, "Score variants"), the same for forward and
/// backward.
struct AttentionProblem {
  std::int64_t batch = 0, tq = 0, tk = 0, hq = 0, hkv = 0, dh = 0;
  float scale = 1.0f;
  bool causal = true;
  CausalAlign align = CausalAlign::bottom_right;
  ScoreVariants var;
  int threads = 1;
  CallSite site;  // entry point and kernel name, for ResourceError messages

  std::int64_t group() const { return hq / hkv; }  // g of SPEC 4.8
  /// p(t): query t's absolute position, t + (T_k − T_q) bottom-right, t top-left (SPEC 4.3).
  std::int64_t position(std::int64_t t) const {
    return align == CausalAlign::bottom_right ? t + (tk - tq) : t;
  }
  /// Query t sees keys [0, visible_end(t)) under the causal mask alone; ≤ 0 means no key (4.3).
  std::int64_t visible_end(std::int64_t t) const {
    if (!causal) return tk;
    const std::int64_t end = position(t) + 1;
    return end < tk ? end : tk;
  }
  /// The keys row (b, h, t) sees: the causal mask (4.3) ∩ the window (p(t) − W < u) ∩ the key
  /// length of sequence b ∩ the row's interval of an interval-shaped boolean mask; clamped to
  /// [0, T_k], begin ≤ end.
  KeyRange key_range(std::int64_t b, std::int64_t h, std::int64_t t) const {
    std::int64_t begin = 0, end = visible_end(t);
    if (var.window > 0) begin = std::max(begin, position(t) - var.window + 1);
    if (var.key_lengths != nullptr) end = std::min(end, var.key_lengths[b]);
    if (var.row_begin != nullptr) {
      const std::int64_t i = b * var.r0 + h * var.r1 + t * var.r2;
      begin = std::max(begin, var.row_begin[i]);
      end = std::min(end, var.row_end[i]);
    }
    end = std::clamp<std::int64_t>(end, 0, tk);
    begin = std::clamp<std::int64_t>(begin, 0, end);
    return {begin, end};
  }
  /// The score entering the softmax for z = s·⟨q_t, k_u⟩ of a key inside key_range(b, h, t)
  /// (scalar form of the element-wise terms): cap(z) + b_h(t, u) + bias, or −∞ where a boolean
  /// mask excludes the key (selected: a NaN z does not leak through).
  float score(float z, std::int64_t b, std::int64_t h, std::int64_t t, std::int64_t u) const {
    if (var.mask_kind == MaskKind::boolean &&
        static_cast<const std::uint8_t*>(var.mask)[mask_offset(b, h, t, u)] == 0) {
      return -std::numeric_limits<float>::infinity();
    }
    float x = var.cap_alibi(z, h, position(t) - u);
    if (var.mask_kind == MaskKind::bias)
      x += static_cast<const float*>(var.mask)[mask_offset(b, h, t, u)];
    return x;
  }
  std::int64_t mask_offset(std::int64_t b, std::int64_t h, std::int64_t t, std::int64_t u) const {
    return b * var.m0 + h * var.m1 + t * var.m2 + u * var.m3;
  }
};

struct ForwardArgs {
  AttentionProblem p;
  DType dtype = DType::f32;  // of q, k, v, out (f32, bf16, f16; the kernel's column)
  In q, k, v;  // q [B,T_q,H_q,d_h], k/v [B,T_k,H_kv,d_h]; unit stride along d_h NOT assumed
  Out out;     // [B,T_q,H_q,d_h]
  Out lse;     // [B,H_q,T_q] (s0,s1,s2 used); data may be null
};

struct BackwardArgs {
  AttentionProblem p;
  DType dtype = DType::f32;  // of q, k, v, out, dout, dq, dk, dv (lse is f32)
  In q, k, v, out, lse, dout;
  Out dq, dk, dv;
  // dsinks is not a kernel output: the API computes dσ_h = −Σ_{b,t} e^{σ_h − L_t} D_t from L,
  // O and dO (SPEC "Score variants": sinks) once for every path.
};

// ---- Decode: attention of a few new queries against a KVCache (src/decode/decode.cpp) ----
// Cache layout: KVTileLayout (kernels/kv_tile_layout.hpp), element type `dtype`.
// Work unit = (sequence b, KV head j, query block, key chunk); units are independent and each
// writes its own partial (unnormalised Õ = Σ_u e^{S_u − m} v_u, running max m,
// sum l = Σ_u e^{S_u − m}) for rows r = t_local · g + h_local. The caller merges the chunks of a
// row in chunk order (SPEC "Merging partial results" with L = m + log l), so nothing depends on
// the thread count.
inline constexpr std::int64_t kDecodeKeyTile = KVTileLayout::kKeyTile;  // keys per decode tile

/// Per-worker scratch of the decode kernels, declared once for the caller (which allocates it)
/// and both kernels (which carve it).
struct DecodeScratch {
  Slot<float> q_scaled;  // scale · Q rows [rows][d_h]
  Slot<float> scores;    // the S, then P, tile [rows][kDecodeKeyTile]
  Slot<float> k_f32;     // portable kernel: one K tile widened to fp32 [d_h][kDecodeKeyTile]
  Slot<float> v_f32;     // portable kernel: its V rows widened to fp32 [kDecodeKeyTile][d_h]
  Slot<float> q_folded;  // quantized caches: scale · Q ⊙ δ_τ of a K tile, transposed [d_h][rows]
  Slot<float> q_colmax;  // quantized caches (SIMD): max over the rows of |scale · Q| per channel

  DecodeScratch() = default;
  DecodeScratch(ScratchLayout& layout, std::int64_t rows, std::int64_t dh)
      : q_scaled(layout.add<float>(scratch_mul(rows, dh, layout.site(), "decode query rows"))),
        scores(layout.add<float>(rows * kDecodeKeyTile)),  // rows ≤ 128 (decode.cpp)
        k_f32(layout.add<float>(scratch_mul(kDecodeKeyTile, dh, layout.site(), "a K tile"))),
        v_f32(layout.add<float>(scratch_mul(kDecodeKeyTile, dh, layout.site(), "a V tile"))),
        q_folded(layout.add<float>(scratch_mul(rows, dh, layout.site(), "decode query rows"))),
        q_colmax(layout.add<float>(dh)) {}
};

struct DecodeArgs {
  std::int64_t batch = 0, tnew = 0, hq = 0, hkv = 0, dh = 0;
  float scale = 1.0f;
  /// Score variants (SPEC "Score variants used by real models"): window, softcap, alibi (the
  /// [H_q] slopes, contiguous) are applied by the kernels; sinks ([H_q], contiguous) by the merge
  /// in src/decode/decode.cpp (the sink joins the merged denominator). Masks and key lengths are
  /// not decode options (their fields stay empty).
  ScoreVariants var;
  /// Rolling cache: slots per sequence (position u lives in slot u mod ring); 0 = off.
  std::int64_t ring = 0;
  DType dtype = DType::f32;
  KVTileLayout layout;            // where K and V elements live (kv_tile_layout.hpp)
  const void* k_layer = nullptr;  // the layer's first element (K tiles are addressed from it)
  const void* v_layer = nullptr;  // = k_layer + layout.k_span() (V tiles addressed from it)
  /// Quantized caches (SPEC "Quantized KV cache"): the open K tiles of the call's sequences,
  /// fp32 [B][H_kv][d_h][kDecodeKeyTile] (keys in lanes, unquantized: the tile still being
  /// filled); null otherwise. See open_start / open_tile.
  const float* k_open = nullptr;
  /// V read in place (src/api/short_query.cpp) instead of from V tiles: the rows of a caller's
  /// [B, T, H_kv, d_h] tensor of element type `dtype`, V[b, u, j, x] at element
  /// b·s0 + u·s1 + j·s2 + x of `data` (feature stride 1; the key stride s1 is any). null: off.
  /// Then v_layer is unused, the layout holds K tiles alone (tile_offset) and the kernels take
  /// keys u0.. of (b, j) at v_row(b, j, u0) with row stride v_stride() = s1 instead of d_h. Set
  /// only through read_v_in_place: activation dtypes (f32, bf16, f16), never a quantized cache
  /// (whose V rows need their tile's scales) nor a ring.
  struct VRows {
    const void* data = nullptr;
    std::int64_t s0 = 0, s1 = 0, s2 = 0;
  };
  VRows v_rows;
  const std::int32_t* table = nullptr;  // [batch][table_width] physical blocks of the sequences
  std::int64_t table_width = 0;
  const std::int64_t* lengths = nullptr;  // [batch] cached positions of each sequence (this layer)
  In q;                                   // [batch, tnew, hq, dh]
  std::int64_t qblock = 1;                // query positions per unit
  std::int64_t qblocks = 1;               // ceil(tnew / qblock)
  std::int64_t chunk = 0;                 // keys per chunk (multiple of kDecodeKeyTile)
  std::int64_t chunks = 0;                // chunks of the longest sequence, from chunk_base(b)
  float* part_acc = nullptr;              // [units][rows_max][dh]
  float* part_m = nullptr;                // [units][rows_max]
  float* part_l = nullptr;                // [units][rows_max]
  DecodeScratch slots;                    // per-worker buffers ...
  WorkerScratch scratch;                  // ... in these regions (worker w: scratch.at(slot, w))
  int threads = 1;
  /// fp8 E4M3 cache on AVX-512: read the codes straight as fp32 bits where the kernel can
  /// (simd/decode_reader_fp8-inl.h, kDirectBuilt; detail::fp8_direct_widening decides). Same
  /// results as false while no product is subnormal; other kernels ignore it.
  bool fp8_direct = false;
  /// AVX-512 and AVX2: prefetch the next K/V tile pair in address order for every cache dtype,
  /// not only those of the path's per-dtype choice (simd/decode_blocking-inl.h, kLinearPrefetch;
  /// detail::linear_decode_prefetch decides). The same results either way; other kernels ignore
  /// it.
  bool linear_prefetch = false;
  /// AVX-512, int8, fp8 or bf16 cache: each tile's two products on AMX tiles (simd/amx_decode.hpp;
  /// detail::decode_amx decides, having asked Linux for the tile data). The same results at fp32
  /// rounding level, not bitwise; other kernels ignore it. A worker thread
  /// Linux refuses the tile data sets *amx_refused and takes the FMA products; the caller then
  /// throws (a call's results never depend on which worker ran where).
  bool amx = false;
  std::atomic<bool>* amx_refused = nullptr;
  /// Batches of mixed lengths: chunk_first[b] = Σ_{b' < b} chunks_of(b') ([batch + 1] entries,
  /// each sequence ≥ 1 chunk), so units exist only for the chunks a sequence has (work follows
  /// the keys, not B × the longest). nullptr: every sequence has `chunks` chunks.
  const std::int64_t* chunk_first = nullptr;

  std::int64_t group() const { return hq / hkv; }
  std::int64_t rows_max() const { return group() * qblock; }
  /// Units (b, KV head j, query block qb, chunk c): a sequence's are contiguous, numbered
  /// ((j · qblocks + qb) · chunks_of(b) + c) from first_chunk(b) · H_kv · qblocks on.
  std::int64_t chunks_of(std::int64_t b) const {
    return chunk_first != nullptr ? chunk_first[b + 1] - chunk_first[b] : chunks;
  }
  std::int64_t first_chunk(std::int64_t b) const {
    return chunk_first != nullptr ? chunk_first[b] : b * chunks;
  }
  std::int64_t units() const { return first_chunk(batch) * hkv * qblocks; }
  /// Units a worker takes at a time in the SIMD decode kernels' schedule (`schedule(dynamic,
  /// run)`: runs [k·run, (k + 1)·run)). Consecutive units are consecutive chunks of one
  /// (sequence, KV head, query block), the next stretch of the same forward K/V stream, so within
  /// a run a worker's stream (and its software prefetch, which runs on into the next chunk) goes
  /// on where the last chunk ended instead of jumping a chunk per worker ahead. At most 16 units,
  /// and at least 4 runs per worker so that the dynamic schedule still balances (1 for small
  /// calls). Which worker computes a unit never changes its result.
  static constexpr std::int64_t run_units(std::int64_t units, std::int64_t workers) {
    return std::clamp<std::int64_t>(units / (4 * std::max<std::int64_t>(workers, 1)), 1, 16);
  }
  std::int64_t unit_index(std::int64_t b, std::int64_t j, std::int64_t qb, std::int64_t c) const {
    return first_chunk(b) * hkv * qblocks + (j * qblocks + qb) * chunks_of(b) + c;
  }
  struct Unit {
    std::int64_t c, qb, j, b;
  };
  /// The unit numbered u (the inverse of unit_index; a binary search over chunk_first).
  Unit unit_at(std::int64_t u) const {
    const std::int64_t per = hkv * qblocks;  // units per chunk of a sequence
    const std::int64_t b =
        chunk_first != nullptr
            ? std::upper_bound(chunk_first, chunk_first + batch + 1, u / per) - chunk_first - 1
            : u / (per * chunks);
    const std::int64_t n = chunks_of(b), rem = u - first_chunk(b) * per;
    return {rem % n, rem / n % qblocks, rem / (n * qblocks), b};
  }
  /// Query t of sequence b (at position p = L_b − T_new + t) sees keys [visible_begin,
  /// visible_end): u ≤ p (bottom-right, SPEC 4.3) and, with a window W, p − W < u. Empty when
  /// visible_end ≤ visible_begin (visible_end may be ≤ 0).
  std::int64_t visible_end(std::int64_t b, std::int64_t t) const {
    return lengths[b] - tnew + t + 1;
  }
  std::int64_t visible_begin(std::int64_t b, std::int64_t t) const {
    return var.window > 0 ? std::max<std::int64_t>(0, visible_end(b, t) - var.window) : 0;
  }
  /// Keys of sequence b seen by the query rows t ∈ [t0, t0 + n) (n ≥ 1; every head alike): some
  /// row sees [begin, end) (none: begin = INT64_MAX, end = 0), every row sees [full_begin,
  /// full_end). From the row ranges alone, in O(1): visible_end and visible_begin do not decrease
  /// with t, and row t sees a key iff visible_end(b, t) > 0 (then visible_begin < visible_end, as
  /// W ≥ 1); the first such row starts at visible_begin(b, t0), or at 0 if visible_end(b, t0) ≤ 0
  /// (its end is 1). A decode unit finds its keys with it before any per-row work.
  struct KeyRange {
    std::int64_t begin, end, full_begin, full_end;
  };
  KeyRange key_range(std::int64_t b, std::int64_t t0, std::int64_t n) const {
    const std::int64_t t1 = t0 + n - 1;
    KeyRange k{INT64_MAX, 0, visible_begin(b, t1), visible_end(b, t0)};
    if (visible_end(b, t1) > 0) {
      k.end = visible_end(b, t1);
      k.begin = visible_end(b, t0) > 0 ? visible_begin(b, t0) : 0;
    }
    return k;
  }
  /// First key of chunk 0 of sequence b: the key tile holding the first query's window start (0
  /// without a window). Chunk c covers keys [chunk_base + c·chunk, chunk_base + (c+1)·chunk), so
  /// tiles before the window are never visited (decode with a window reads O(W) keys).
  std::int64_t chunk_base(std::int64_t b) const {
    return visible_begin(b, 0) / kDecodeKeyTile * kDecodeKeyTile;
  }
  /// Element offset, from k_layer for the K tile and from v_layer for its V tile, of the tile
  /// holding key u of sequence b, KV head j (a rolling cache holds it in slot u mod ring).
  /// With V read in place (v_rows) the V tiles are absent: the K tiles of a (block, KV head)
  /// follow each other, [pool_blocks][H_kv][block_tokens / 64] K tiles (no scales: an activation
  /// dtype), and the offset is that of the K tile in this dense layout.
  std::int64_t tile_offset(std::int64_t b, std::int64_t j, std::int64_t u) const {
    const std::int64_t s = ring != 0 ? u % ring : u;
    const std::int64_t block = table[b * table_width + s / layout.block_tokens];
    const std::int64_t pos = s % layout.block_tokens;
    if (v_in_place()) {
      const std::int64_t tiles = layout.block_tokens / kDecodeKeyTile;  // per (block, head)
      return ((block * layout.heads_kv + j) * tiles + pos / kDecodeKeyTile) * layout.tile_elems();
    }
    return layout.k_tile(block, j, pos);
  }
  /// Quantized caches: the first key of sequence b's open tile (keys [open_start, L_b), read
  /// from open_tile(b, j) instead of the K tile at tile_offset), or −1 when every tile is closed
  /// (L_b a multiple of 64).
  std::int64_t open_start(std::int64_t b) const {
    return lengths[b] % kDecodeKeyTile != 0 ? lengths[b] / kDecodeKeyTile * kDecodeKeyTile : -1;
  }
  const float* open_tile(std::int64_t b, std::int64_t j) const {
    return k_open + (b * hkv + j) * dh * kDecodeKeyTile;
  }
  bool v_in_place() const { return v_rows.data != nullptr; }
  /// Element offset, from v_rows.data, of the V row of key u of sequence b, KV head j (in place).
  std::int64_t v_row(std::int64_t b, std::int64_t j, std::int64_t u) const {
    return b * v_rows.s0 + u * v_rows.s1 + j * v_rows.s2;
  }
  /// Elements from one key's V row to the next's: s1 in place, d_h in a V tile.
  std::int64_t v_stride() const { return v_in_place() ? v_rows.s1 : dh; }
  /// Reads V's rows in place from `v` ([B, T, H_kv, d_h], element type `dtype`, v.s3 = 1), with
  /// K in tiles alone (see v_rows). Throws UnsupportedError naming `site` for a quantized dtype,
  /// a ring or a feature stride other than 1 (an internal misuse: callers check first).
  void read_v_in_place(const In& v, const CallSite& site) {
    if (is_quantized(dtype) || ring != 0 || v.s3 != 1) {
      throw UnsupportedError(std::string(site.entry) +
                             ": V rows read in place need an activation dtype (f32, bf16, f16), "
                             "no rolling cache and a feature stride of 1; got dtype " +
                             to_string(dtype) + ", ring " + std::to_string(ring) +
                             ", feature stride " + std::to_string(v.s3));
    }
    v_rows = {v.data, v.s0, v.s1, v.s2};
  }
  /// Score of a key inside the row's visible range, from z = s·⟨q, k_u⟩ (the scalar form of the
  /// element-wise variants): cap(z) − m_h·(p − u).
  float score(float z, std::int64_t b, std::int64_t h, std::int64_t t, std::int64_t u) const {
    return var.cap_alibi(z, h, visible_end(b, t) - 1 - u);  // p = visible_end − 1
  }
};
// Decode kernels are called inside the caller's OpenMP parallel region (one region per call:
// units, then the merge) and share out units with an orphaned `omp for` (a plain loop when
// called outside a region); worker w uses the slots of scratch region w.

using ForwardKernel = void (*)(const ForwardArgs&);
using BackwardKernel = void (*)(const BackwardArgs&);
using DecodeKernel = void (*)(const DecodeArgs&);

// ---- The kernels (named attention_<op>_<dtype>_<isa>; the registry maps ISA → kernels) ----

// Portable (src/kernels/portable/): plain C++, every CPU, any T_k.
void attention_fwd_f32_portable(const ForwardArgs& args);
void attention_bwd_f32_portable(const BackwardArgs& args);
// bf16 / f16 activations (SPEC "Reduced precision"): the fp32 kernels' arithmetic on operands
// widened exactly on pack, O, dQ, dK, dV rounded (nearest even) once on store.
void attention_fwd_bf16_portable(const ForwardArgs& args);
void attention_fwd_f16_portable(const ForwardArgs& args);
void attention_bwd_bf16_portable(const BackwardArgs& args);
void attention_bwd_f16_portable(const BackwardArgs& args);
void attention_decode_f32_portable(const DecodeArgs& args);
void attention_decode_bf16_portable(const DecodeArgs& args);
void attention_decode_f16_portable(const DecodeArgs& args);
void attention_decode_int8_portable(const DecodeArgs& args);
void attention_decode_fp8_e4m3_portable(const DecodeArgs& args);

// SIMD (src/kernels/simd/, Highway): the per-target instantiations, one constant per target
// (x86: AVX2, AVX-512; AArch64: NEON); null where this build has no code for the target (the
// x86 constants in an AArch64 build and the NEON ones in an x86 build). Query and key
// positions are indexed with int32 lanes: they serve T_k < 2^31 − 1 (KernelSet::max_keys).
extern const ForwardKernel attention_fwd_f32_avx2, attention_fwd_f32_avx512;
extern const BackwardKernel attention_bwd_f32_avx2, attention_bwd_f32_avx512;
// bf16 / f16 activations, widened to fp32 where the kernels pack Q, K, V (and dO, O) tiles.
extern const ForwardKernel attention_fwd_bf16_avx2, attention_fwd_f16_avx2,
    attention_fwd_bf16_avx512, attention_fwd_f16_avx512, attention_fwd_bf16_neon,
    attention_fwd_f16_neon;
extern const BackwardKernel attention_bwd_bf16_avx2, attention_bwd_f16_avx2,
    attention_bwd_bf16_avx512, attention_bwd_f16_avx512, attention_bwd_bf16_neon,
    attention_bwd_f16_neon;
extern const DecodeKernel attention_decode_f32_avx2, attention_decode_bf16_avx2,
    attention_decode_f16_avx2, attention_decode_int8_avx2, attention_decode_fp8_e4m3_avx2;
extern const DecodeKernel attention_decode_f32_avx512, attention_decode_bf16_avx512,
    attention_decode_f16_avx512, attention_decode_int8_avx512, attention_decode_fp8_e4m3_avx512;
// Path avx512_bf16: the AVX-512 forward with vdpbf16ps products for bf16 (simd/dpbf16.hpp);
// null in builds without the AVX512-BF16 translation unit (non-x86).
extern const ForwardKernel attention_fwd_bf16_avx512bf16;
// ... and its backward with S and dP on vdpbf16ps (D-bf16-8); null likewise.
extern const BackwardKernel attention_bwd_bf16_avx512bf16;
extern const ForwardKernel attention_fwd_f32_neon;
extern const BackwardKernel attention_bwd_f32_neon;
extern const DecodeKernel attention_decode_f32_neon, attention_decode_bf16_neon,
    attention_decode_f16_neon, attention_decode_int8_neon, attention_decode_fp8_e4m3_neon;
// Test hook: the SIMD kernels' soft-capping tanh (simd/tanh-inl.h), y[i] = tanh(x[i]), i < n,
// per target (null where not built), for tests/unit/test_softcap_tanh.cpp.
using TanhKernel = void (*)(const float* x, float* y, std::int64_t n);
extern const TanhKernel softcap_tanh_avx2, softcap_tanh_avx512, softcap_tanh_neon;
// Test hook: the SIMD kernels' softmax exp (ExpNaN over simd/exp-inl.h's SoftmaxExp),
// y[i] = e^x[i], i < n, per target (null where not built), for tests/unit/test_softmax_exp.cpp.
using ExpKernel = TanhKernel;  // y[i] = f(x[i]), i < n
extern const ExpKernel softmax_exp_avx2, softmax_exp_avx512, softmax_exp_neon;
// The readings of fp8 E4M3 cache elements the widening test hook exercises (int8 has one):
// through f16 bits (fp8_e4m3_t, q · 2^−8), directly as fp32 bits (fp8_e4m3_direct_t, q · 2^−120;
// four vectors at a time as fp8_e4m3_quad_t) and the quad reading at the f16 unit
// (fp8_e4m3_quad_f16unit_t, q · 2^−8).
enum class Fp8Reading { f16, direct, quad_f16unit };
// Test hook: the SIMD microkernel's widening of quantized KV-cache elements (LoadB / LoadBRow,
// simd/microkernel-inl.h): n int8 or fp8 E4M3 bytes (dtype) → fp32 q · kLoadBUnit (the unit of
// the reading: 1 for int8), one vector at a time into by_vector and four at a time into by_row
// (a split reading's columns put back in order: UnsplitQuads); per target (null where not
// built), for tests/unit/test_kv_quant.cpp.
using WidenKernel = void (*)(DType dtype, Fp8Reading reading, const std::uint8_t* q, std::int64_t n,
                             float* by_vector, float* by_row);
extern const WidenKernel widen_quantized_avx2, widen_quantized_avx512, widen_quantized_neon;

}  // namespace tokenmix::kernels
