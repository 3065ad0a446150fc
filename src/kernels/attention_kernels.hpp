// src/kernels/attention_kernels.hpp — the internal interface between the public API (which
// validates and dispatches) and the kernels (which compute). Everything here is already
// checked: shapes agree, pointers are valid, sizes fit, outputs do not alias inputs.
#pragma once

#include <cstdint>

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
  In q, k, v;   // q [B,T_q,H_q,d_h], k/v [B,T_k,H_kv,d_h]; unit stride along d_h NOT assumed
  Out out;      // [B,T_q,H_q,d_h]
  Out lse;      // [B,H_q,T_q] (s0,s1,s2 used); data may be null
};

struct BackwardArgs {
  AttentionProblem p;
  In q, k, v, out, lse, dout;
  Out dq, dk, dv;
};

using ForwardKernel = void (*)(const ForwardArgs&);
using BackwardKernel = void (*)(const BackwardArgs&);

// Portable fp32 kernels (src/kernels/portable/): plain C++, every CPU.
void attention_fwd_f32_portable(const ForwardArgs& args);
void attention_bwd_f32_portable(const BackwardArgs& args);

// SIMD flash-attention forward (src/kernels/simd/, Highway, one instantiation per x86 target).
// Returns nullptr if this build has no kernel for `isa` (e.g. not an x86 build). The caller
// has checked that the CPU supports `isa`. Query positions are indexed with int32 lanes:
// callers use the portable kernel when T_k >= 2^31.
ForwardKernel simd_forward_kernel(Isa isa);

// SIMD flash-attention backward (src/kernels/simd/attention_bwd_f32_hwy.cpp); same contract.
BackwardKernel simd_backward_kernel(Isa isa);

/// The kernels for a resolved ISA (portable if no SIMD kernel exists for it).
ForwardKernel forward_kernel(Isa isa);
BackwardKernel backward_kernel(Isa isa);

// ---- Decode: attention of a few new queries against a KVCache (src/api/decode.cpp) ----
// Cache layout (tokenmix/kv_cache.hpp): per layer, physical block p and KV head j hold
// block_tokens / 64 pairs of tiles, K tile [d_h][64] then V tile [64][d_h] (element type `dtype`).
// Work unit = (sequence b, KV head j, query block, key chunk); units are independent and each
// writes its own partial (unnormalised Õ = Σ_u e^{s_u − m} v_u, running max m,
// sum l = Σ_u e^{s_u − m}) for rows r = t_local · g + h_local. The caller merges the chunks of a
// row in chunk order (SPEC "Merging partial results" with L = m + log l), so nothing depends on
// the thread count.
struct DecodeArgs {
  std::int64_t batch = 0, tnew = 0, hq = 0, hkv = 0, dh = 0;
  float scale = 1.0f;
  DType dtype = DType::f32;
  const void* k_layer =
      nullptr;  // the layer: [pool_blocks][H_kv][block_tokens / 64][K tile, V tile]
  const void* v_layer = nullptr;  // = k_layer + 64 · d_h elements (the first V tile)
  std::int64_t block_tokens = 0;  // multiple of kDecodeKeyTile
  const std::int32_t* table = nullptr;  // [batch][table_width] physical blocks of the call's sequences
  std::int64_t table_width = 0;
  const std::int64_t* lengths = nullptr;  // [batch] cached positions of each sequence (this layer)
  In q;                                   // [batch, tnew, hq, dh]
  std::int64_t qblock = 1;   // query positions per unit
  std::int64_t qblocks = 1;  // ceil(tnew / qblock)
  std::int64_t chunk = 0;    // keys per chunk (multiple of kDecodeKeyTile)
  std::int64_t chunks = 0;   // chunks per (b, j, query block)
  float* part_acc = nullptr;  // [units][rows_max][dh]
  float* part_m = nullptr;    // [units][rows_max]
  float* part_l = nullptr;    // [units][rows_max]
  float* scratch = nullptr;   // [threads][scratch_floats()], 64-byte aligned, per worker
  int threads = 1;
  /// Per-worker scratch: s·Q rows (padded to 64 floats), the S/P tile [rows][64], and one K tile
  /// plus 64 V rows widened to fp32 (portable kernel).
  std::int64_t scratch_floats() const {
    return (rows_max() * dh + 63) / 64 * 64 + rows_max() * 64 + 2 * 64 * dh;
  }

  std::int64_t group() const { return hq / hkv; }
  std::int64_t rows_max() const { return group() * qblock; }
  std::int64_t units() const { return batch * hkv * qblocks * chunks; }
  /// Query t of sequence b sees keys [0, visible_end) (bottom-right, SPEC 4.3); may be ≤ 0.
  std::int64_t visible_end(std::int64_t b, std::int64_t t) const { return lengths[b] - tnew + t + 1; }
  /// Element offset, from k_layer for the K tile and from v_layer for its V tile, of the tile
  /// holding key u of sequence b, KV head j.
  std::int64_t tile_offset(std::int64_t b, std::int64_t j, std::int64_t u) const {
    const std::int64_t blk = table[b * table_width + u / block_tokens], off = u % block_tokens;
    return ((blk * hkv + j) * 2 * block_tokens + 2 * (off / 64 * 64)) * dh;
  }
};
inline constexpr std::int64_t kDecodeKeyTile = 64;  // = KVCache::kKeyTile
// Decode kernels are called inside the caller's OpenMP parallel region (one region per call:
// units, then the merge) and share out units with an orphaned `omp for` (a plain loop when
// called outside a region); worker w uses scratch + w · scratch_floats().
using DecodeKernel = void (*)(const DecodeArgs&);

// Portable decode (src/kernels/portable/attention_decode_portable.cpp): plain C++, every CPU.
void attention_decode_portable(const DecodeArgs& args);
// SIMD decode (src/kernels/simd/attention_decode_hwy.cpp); nullptr if not built for `isa`.
DecodeKernel simd_decode_kernel(Isa isa);

}  // namespace tokenmix::kernels
