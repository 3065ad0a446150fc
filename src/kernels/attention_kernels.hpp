// src/kernels/attention_kernels.hpp — the internal interface between the public API (which
// validates and dispatches) and the kernels (which compute). Everything here is already
// checked: shapes agree, pointers are valid, sizes fit, outputs do not alias inputs.
//
// Which kernel runs for which ISA and dtype is decided in one place, the registry
// (kernels/registry.cpp); this header only declares the kernels it lists.
#pragma once

#include <cstdint>

#include "kernels/kv_tile_layout.hpp"
#include "kernels/scratch_arena.hpp"
#include "tokenmix/attention.hpp"
#include "tokenmix/tensor.hpp"

namespace tokenmix::kernels {

/// A float tensor of logical shape [B, T, H, d_h] (or [B, H, T] for LSE) with element strides.
template <class Pointer>
struct Strided {
  Pointer data = nullptr;
  std::int64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
  Pointer row(std::int64_t i0, std::int64_t i1, std::int64_t i2) const {
    return data + i0 * s0 + i1 * s1 + i2 * s2;
  }
};
using In = Strided<const float*>;
using Out = Strided<float*>;

/// One attention problem (SPEC 4.2–4.5, 4.8), the same for forward and backward.
struct AttentionProblem {
  std::int64_t batch = 0, tq = 0, tk = 0, hq = 0, hkv = 0, dh = 0;
  float scale = 1.0f;
  bool causal = true;
  CausalAlign align = CausalAlign::bottom_right;
  int threads = 1;
  CallSite site;  // entry point and kernel name, for ResourceError messages

  std::int64_t group() const { return hq / hkv; }  // g of SPEC 4.8
  /// Query t sees keys [0, visible_end(t)); ≤ 0 means no key (SPEC 4.3).
  std::int64_t visible_end(std::int64_t t) const {
    if (!causal) return tk;
    const std::int64_t shift = align == CausalAlign::bottom_right ? tk - tq : 0;
    const std::int64_t end = t + 1 + shift;
    return end < tk ? end : tk;
  }
};

struct ForwardArgs {
  AttentionProblem p;
  In q, k, v;  // q [B,T_q,H_q,d_h], k/v [B,T_k,H_kv,d_h]; unit stride along d_h NOT assumed
  Out out;     // [B,T_q,H_q,d_h]
  Out lse;     // [B,H_q,T_q] (s0,s1,s2 used); data may be null
};

struct BackwardArgs {
  AttentionProblem p;
  In q, k, v, out, lse, dout;
  Out dq, dk, dv;
};

// ---- Decode: attention of a few new queries against a KVCache (src/api/decode.cpp) ----
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

  DecodeScratch() = default;
  DecodeScratch(ScratchLayout& layout, std::int64_t rows, std::int64_t dh)
      : q_scaled(layout.add<float>(scratch_mul(rows, dh, layout.site(), "decode query rows"))),
        scores(layout.add<float>(rows * kDecodeKeyTile)),  // rows ≤ 128 (decode.cpp)
        k_f32(layout.add<float>(scratch_mul(kDecodeKeyTile, dh, layout.site(), "a K tile"))),
        v_f32(layout.add<float>(scratch_mul(kDecodeKeyTile, dh, layout.site(), "a V tile"))) {}
};

struct DecodeArgs {
  std::int64_t batch = 0, tnew = 0, hq = 0, hkv = 0, dh = 0;
  float scale = 1.0f;
  DType dtype = DType::f32;
  KVTileLayout layout;            // where K and V elements live (kv_tile_layout.hpp)
  const void* k_layer = nullptr;  // the layer's first element (K tiles are addressed from it)
  const void* v_layer = nullptr;  // = k_layer + layout.tile_elems() (V tiles addressed from it)
  const std::int32_t* table = nullptr;  // [batch][table_width] physical blocks of the sequences
  std::int64_t table_width = 0;
  const std::int64_t* lengths = nullptr;  // [batch] cached positions of each sequence (this layer)
  In q;                                   // [batch, tnew, hq, dh]
  std::int64_t qblock = 1;                // query positions per unit
  std::int64_t qblocks = 1;               // ceil(tnew / qblock)
  std::int64_t chunk = 0;                 // keys per chunk (multiple of kDecodeKeyTile)
  std::int64_t chunks = 0;                // chunks per (b, j, query block)
  float* part_acc = nullptr;              // [units][rows_max][dh]
  float* part_m = nullptr;                // [units][rows_max]
  float* part_l = nullptr;                // [units][rows_max]
  DecodeScratch slots;                    // per-worker buffers ...
  WorkerScratch scratch;                  // ... in these regions (worker w: scratch.at(slot, w))
  int threads = 1;

  std::int64_t group() const { return hq / hkv; }
  std::int64_t rows_max() const { return group() * qblock; }
  std::int64_t units() const { return batch * hkv * qblocks * chunks; }
  /// Query t of sequence b sees keys [0, visible_end) (bottom-right, SPEC 4.3); may be ≤ 0.
  std::int64_t visible_end(std::int64_t b, std::int64_t t) const {
    return lengths[b] - tnew + t + 1;
  }
  /// Element offset, from k_layer for the K tile and from v_layer for its V tile, of the tile
  /// holding key u of sequence b, KV head j.
  std::int64_t tile_offset(std::int64_t b, std::int64_t j, std::int64_t u) const {
    const std::int64_t block = table[b * table_width + u / layout.block_tokens];
    return layout.k_tile(block, j, u % layout.block_tokens);
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
void attention_decode_f32_portable(const DecodeArgs& args);
void attention_decode_bf16_portable(const DecodeArgs& args);
void attention_decode_f16_portable(const DecodeArgs& args);

// SIMD (src/kernels/simd/, Highway): the per-target instantiations, one constant per target
// (x86: AVX2, AVX-512; AArch64: NEON); null where this build has no code for the target (the
// x86 constants in an AArch64 build and the NEON ones in an x86 build). Query and key
// positions are indexed with int32 lanes: they serve T_k < 2^31 − 1 (KernelSet::max_keys).
extern const ForwardKernel attention_fwd_f32_avx2, attention_fwd_f32_avx512;
extern const BackwardKernel attention_bwd_f32_avx2, attention_bwd_f32_avx512;
extern const DecodeKernel attention_decode_f32_avx2, attention_decode_bf16_avx2,
    attention_decode_f16_avx2;
extern const DecodeKernel attention_decode_f32_avx512, attention_decode_bf16_avx512,
    attention_decode_f16_avx512;
extern const ForwardKernel attention_fwd_f32_neon;
extern const BackwardKernel attention_bwd_f32_neon;
extern const DecodeKernel attention_decode_f32_neon, attention_decode_bf16_neon,
    attention_decode_f16_neon;

}  // namespace tokenmix::kernels
