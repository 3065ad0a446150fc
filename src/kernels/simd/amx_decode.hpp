// src/kernels/simd/amx_decode.hpp — decode's two per-tile products over an int8, fp8 or bf16 KV
// cache on Intel AMX tiles (16 × 16 fp32 / int32 tiles of byte-quad or bf16-pair dot products),
// for the AVX-512 decode kernel (decode_amx-inl.h) where DecodeArgs::amx is set: the CPU
// has AMX-TILE, AMX-INT8 (int8 cache) or AMX-BF16 with AVX512-BF16 and VBMI (fp8, bf16), the OS
// saves tile state and granted this process the tile data (CpuFeatures::amx_int8 / amx_bf16,
// detail::decode_amx). Intrinsics in their own translation unit (amx_decode.cpp), called once per
// unit and per 64-key tile.
//
// int8 cache (TDPBSSD, TDPBUSD). The cache's elements q are integers, so a product with integer A
// rows is an exact int32 sum. The fp32 operands become integer planes, per row r, exactly enough
// for fp32 rounding level:
//   (4.2) scale·q_r = 2^−s_r (a₀ + a₁ 2^−7 + a₂ 2^−14 + a₃ 2^−21) + ε,  a_p ∈ [−64, 64],
//         |ε| ≤ 2^−27 · max_x |scale·q_r[x]|   (each plane the rounded rest of the one before);
//         S[r][u] = 2^−s_r Σ_p 2^−7p C_p[r][u],  C_p = Σ_x a_p[x] · K[x][u]   (TDPBSSD, exact)
//   (4.5) P[r][u]·δ_u = 2^−t_r (b₀ + b₁ 2^−8 + b₂ 2^−16) + ε,  b_p ∈ [0, 255] (truncated),
//         0 ≤ ε < 2^−23 · max_u P[r][u]·δ_u;
//         Õ[r][x] += 2^−t_r Σ_p 2^−8p D_p[r][x],  D_p = Σ_u b_p[u] · V[u][x]   (TDPBUSD, exact)
// The planes' sums are added in fp32 (each C_p, D_p < 2^24: exact as fp32). So results agree with
// the FMA products at fp32 rounding level, not bitwise: the error of a score is at most 2^−27 of
// max|q|·Σ|k| (the FMA chain's bound is ≈ d_h·2^−24 of Σ|q k|), of Õ 2^−23 of max P·Σ|v|.
//
// fp8 E4M3 cache (TDPBF16PS). Every E4M3 value (times the decode kernel's unit 2^−8, which the
// kernel takes back out with the scales) is a normal bf16 number: the tiles' B operands are the
// cache's values exactly, widened by two 128-entry byte tables. The fp32 operands become three
// bf16 planes, each the rounded (to nearest) rest of the one before, which hold an fp32 number
// exactly (8 + 8 + 8 significant bits):
//   (4.2) 2^s_r·scale·q_r = h + m + l,  S[r][u] = 2^−s_r Σ_chunks (l·K + m·K + h·K)[r][u]
//   (4.5) 2^t_r·P[r][u]·δ_u = h + m + l, Õ[r][x] += 2^−t_r Σ_halves (l·V + m·V + h·V)[r][x]
// every bf16 product exact and the sums accumulated in the fp32 C tile (32 features or keys per
// product, the planes low to high): the FMA chain's bound. The tiles treat subnormal bf16 inputs
// and products as 0: with the rows scaled to [1, 2) and the widened values ≥ 2^−17, only terms
// below 2^−126 are lost (far below fp32 rounding of a row).
//
// bf16 cache (TDPBF16PS). The stored values are the B operands as they are (word interleaves of
// two rows), the A operands the same three planes, but of rows scaled to [2^40, 2^41): with every
// cache value the tiles take (0, or 2^−126 ≤ |v| < 2^64) no product or sum overflows (< 2^113),
// and the terms the tiles flush (below 2^−126) leave an absolute error below 2^−158 in O. A tile
// holding a value outside that range (NaN, ±∞, subnormal, huge; scanned as it is rewritten) goes
// to the caller's exact fallback (scores, values). Its columns come out permuted within each
// 32-column group (unpacks of words within 128-bit lanes), not as the byte caches' below.
//
// An int8 cache keeps its tiles in VNNI-4 quads (kv_tile_layout.hpp: K [d_h/4][64][4], V
// [16][d_h][4]), the B operands as they are: no rewrite, columns in order. The fp8 cache's B
// operands are built per cache tile (the cache keeps K as [d_h][64] and V as [64][d_h], which the
// FMA kernels read as they are) with byte interleaves that leave the columns of a tile permuted
// within each 64-column group: S is put back in key order as the planes are added; Õ is kept in
// that order for the unit and put back by unpermute().
#pragma once

#include <cstdint>

namespace tokenmix::kernels::amx {

/// True where this thread may run AMX: asks Linux for the tile data permission on the calling
/// thread the first time (ARCH_REQ_XCOMP_PERM; granted per process, asked on every worker thread).
bool thread_ready();

/// Loads the tile configuration on the calling thread (per unit: another library may have loaded
/// its own since).
void configure();

/// Releases the calling thread's tile state (after its last unit of a call).
void release();

/// Whether d_h can take the tile products: a multiple of 64 up to 256.
constexpr bool head_dim_supported(std::int64_t dh) {
  return dh % 64 == 0 && dh <= 256;
}

/// The cache element the tile products read.
enum class Element {
  int8,      // q ∈ [−127, 127]: AMX-INT8
  fp8_e4m3,  // read as q · 2^−8 (the decode kernel's kLoadBUnit): AMX-BF16
  bf16       // the stored bf16 values, where the tiles can take them (see scores): AMX-BF16
};

/// The unit's query planes from qs = (scale·Q)ᵀ [dh][n] (the decode kernel's layout), n ≤ 128,
/// into this thread's workspace, for a cache of `element`. False (nothing to use) where a row's
/// largest |element| is not finite or lies outside [2^−60, 2^60) (and is not 0), or n or dh is
/// outside what the workspace holds: that unit takes the FMA products.
bool query_planes(Element element, const float* qs, std::int64_t n, std::int64_t dh);

/// S[r][0..64) = Σ_x (scale·q_r)[x] K[x][·] for the n rows of the last query_planes, K a tile
/// [dh][64] of its element (int8: [dh/4][64][4], the cache's quads, kv_tile_layout.hpp) (keys in
/// lanes; int8 and fp8 read all 64: keys past the sequence are
/// bytes whose scores the caller masks; bf16 reads keys < nt and scores the others as 0), S rows
/// 64 floats apart, in key order. The bytes [pf, pf + pf_bytes) (the tile pair ahead; pf may be
/// null) are prefetched into L2 over this tile's work: here, in keep_awake() and in values().
/// False (S not written) for a bf16 tile holding a value with |k| ≥ 2^64, ±∞ or NaN among its
/// keys < nt (products on the tiles could overflow where the FMA ones do not): the caller computes
/// that tile's S with FMAs. Subnormal bf16 keys are read as 0 by the tiles: a score's absolute
/// error stays below d_h · 2^−126 · max|scale·q_r| (a relative error of P below 2^−57).
bool scores(const void* k_tile, std::int64_t nt, float* s, const std::uint8_t* pf,
            std::int64_t pf_bytes);

/// Õ[r][·] += Σ_{u < nt} P[r][u] · V[u][·] for the n rows of the last query_planes: P rows 64
/// floats apart (keys [nt, 64) not read), V a tile [64][dh] of its element (int8: [16][dh][4],
/// the cache's quads) (rows past nt: int8 read and weighed by 0, fp8 and bf16 not read), Õ rows
/// dh floats apart in the permuted column order of fp8 and bf16 (see unpermute; int8: in order). A
/// row whose P holds a NaN or ±∞ is added by a scalar loop instead (its output is NaN or ±∞ either
/// way). False (nothing added) for a bf16 tile holding, in its rows < nt, a value the tiles would
/// not take exactly: NaN, ±∞, |v| ≥ 2^64 or a subnormal (read as 0 by the tiles); the caller adds
/// that tile with values_visible.
bool values(const float* p, std::int64_t nt, const void* v_tile, float* acc);

/// Õ_r[·] += Σ_{u ∈ [lo, hi)} P_r[u] · V[u][·], a scalar loop over a bf16 V tile [64][dh] into one
/// Õ row in the permuted column order of the last query_planes: the exact fallback of values()
/// for one row, over the keys it sees (a key it does not see takes no part: 0 · NaN = NaN).
void values_visible(const float* p_row, std::int64_t lo, std::int64_t hi, const void* v_tile,
                    float* acc_row);

/// Õ's n rows of dh columns back in feature order (after the unit's last values(); int8: already
/// in order, nothing to do).
void unpermute(float* acc);

/// Between scores() and values() of a tile, once per softmax row: one product into a dead C tile,
/// so that the tile unit does not go idle (amx_decode.cpp: wake), and the next lines of the pair
/// ahead.
void keep_awake();

}  // namespace tokenmix::kernels::amx
