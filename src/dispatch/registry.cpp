// src/dispatch/registry.cpp — the kernel registry (registry.hpp): which kernel runs for every
// ISA path and dtype. To answer "which kernel runs for bf16 decode on AVX2?", read the avx2
// entry's decode[bf16] below.
#include "dispatch/registry.hpp"

#include <array>
#include <string>

#include "dispatch/cpu_cap.hpp"
#include "tokenmix/error.hpp"

namespace tokenmix::kernels {
namespace {

// T_k bound of the SIMD kernels: query/key positions live in int32 lanes.
constexpr std::int64_t kInt32LaneKeys = (std::int64_t{1} << 31) - 2;
constexpr std::int64_t kAnyKeys = INT64_MAX;

// Decode tuning per path (KernelSet::decode_tunables; the kernels' side: simd/decode_blocking-inl.h
// and the readers). The portable and NEON kernels read fp8 through f16 bits or the scalar decoding,
// have no prefetch cursor and no tile products.
constexpr DecodeTunables kNoDecodeTuning{false, false, false, "row by row"};
// AVX2: the direct fp8 reading (D-fp8-3); by default address order for f32, bf16 and f16, row by
// row for int8 and fp8 (D-prefetch-2), every dtype on request (D-prefetch-6).
constexpr DecodeTunables kAvx2DecodeTuning{true, true, false,
                                           "address order for f32/bf16/f16, int8/fp8 row by row"};
// AVX-512: as AVX2, with address order for f32 only by default (D-prefetch-1), and the AMX tile
// products where the build has them (simd/amx_decode.cpp; D-amx-4).
#if TOKENMIX_HAVE_AMX
constexpr bool kAmxBuilt = true;
#else
constexpr bool kAmxBuilt = false;
#endif
constexpr DecodeTunables kAvx512DecodeTuning{true, true, kAmxBuilt,
                                             "address order for f32, the others row by row"};

// Column order = DType values: f32, bf16, f16 (decode: then int8, fp8_e4m3, cache_column).
// Forward/backward bf16/f16 columns: the fp32 kernels with operands widened on pack and outputs
// rounded on store (SPEC "Reduced precision").
std::array<KernelSet, 5> make_sets() {
  return {{
      {Isa::portable,
       [](const CpuFeatures&) { return true; },
       {{"attention_fwd_f32_portable", &attention_fwd_f32_portable},
        {"attention_fwd_bf16_portable", &attention_fwd_bf16_portable},
        {"attention_fwd_f16_portable", &attention_fwd_f16_portable}},
       {{"attention_bwd_f32_portable", &attention_bwd_f32_portable},
        {"attention_bwd_bf16_portable", &attention_bwd_bf16_portable},
        {"attention_bwd_f16_portable", &attention_bwd_f16_portable}},
       {{"attention_decode_f32_portable", &attention_decode_f32_portable},
        {"attention_decode_bf16_portable", &attention_decode_bf16_portable},
        {"attention_decode_f16_portable", &attention_decode_f16_portable},
        {"attention_decode_int8_portable", &attention_decode_int8_portable},
        {"attention_decode_fp8_e4m3_portable", &attention_decode_fp8_e4m3_portable}},
       kAnyKeys,
       "plain C++, exact fp32: two-pass softmax per query row, O(T_k*d_h) scratch per worker, "
       "OpenMP over (batch, head, 64-row block); decode widens each 64-key cache tile to fp32 "
       "and runs an online softmax per row; score variants (window, softcap, ALiBi, sinks, "
       "masks, key lengths) by key ranges and element-wise score terms; attention dropout by "
       "Philox keep masks (forward and backward); bf16/f16 activations "
       "widened to fp32 on pack, O/dQ/dK/dV rounded once on store",
       /*score_variants=*/true,
       /*automatic=*/true,
       kNoDecodeTuning},
      {Isa::avx2,
       [](const CpuFeatures& f) { return f.avx2_fma; },
       {{"attention_fwd_f32_avx2", attention_fwd_f32_avx2},
        {"attention_fwd_bf16_avx2", attention_fwd_bf16_avx2},
        {"attention_fwd_f16_avx2", attention_fwd_f16_avx2}},
       {{"attention_bwd_f32_avx2", attention_bwd_f32_avx2},
        {"attention_bwd_bf16_avx2", attention_bwd_bf16_avx2},
        {"attention_bwd_f16_avx2", attention_bwd_f16_avx2}},
       {{"attention_decode_f32_avx2", attention_decode_f32_avx2},
        {"attention_decode_bf16_avx2", attention_decode_bf16_avx2},
        {"attention_decode_f16_avx2", attention_decode_f16_avx2},
        {"attention_decode_int8_avx2", attention_decode_int8_avx2},
        {"attention_decode_fp8_e4m3_avx2", attention_decode_fp8_e4m3_avx2}},
       kInt32LaneKeys,
       "Highway AVX2+FMA (8 lanes, 3x3 microkernel): fused flash forward with the GQA heads "
       "stacked in SIMD lanes, online softmax over 64-key tiles, causal tile skipping; flash "
       "backward recomputing tiles in one pass, units (b, KV head, query range) owning dQ of their "
       "rows, dK/dV summed over the ranges in a fixed order); score variants by "
       "per-lane "
       "key ranges (tiles outside every range skipped, sliding window O(W) per row), one "
       "vectorised element-wise pass (softcap, ALiBi, masks) and sinks in the online softmax; "
       "attention dropout by Philox keep masks drawn in the lanes (forward and backward); "
       "decode over the cache's 64-key tiles with bf16/f16/int8/fp8 widened in registers (int8 "
       "and fp8: K's channel scales folded into the query rows once per tile, V's row scales "
       "into the probabilities); bf16/f16 "
       "activations widened to fp32 where Q, K, V tiles are packed (fp32 products), outputs "
       "rounded once on store",
       /*score_variants=*/true,
       /*automatic=*/true,
       kAvx2DecodeTuning},
      {Isa::avx512,
       [](const CpuFeatures& f) { return f.avx512f; },
       {{"attention_fwd_f32_avx512", attention_fwd_f32_avx512},
        {"attention_fwd_bf16_avx512", attention_fwd_bf16_avx512},
        {"attention_fwd_f16_avx512", attention_fwd_f16_avx512}},
       {{"attention_bwd_f32_avx512", attention_bwd_f32_avx512},
        {"attention_bwd_bf16_avx512", attention_bwd_bf16_avx512},
        {"attention_bwd_f16_avx512", attention_bwd_f16_avx512}},
       {{"attention_decode_f32_avx512", attention_decode_f32_avx512},
        {"attention_decode_bf16_avx512", attention_decode_bf16_avx512},
        {"attention_decode_f16_avx512", attention_decode_f16_avx512},
        {"attention_decode_int8_avx512", attention_decode_int8_avx512},
        {"attention_decode_fp8_e4m3_avx512", attention_decode_fp8_e4m3_avx512}},
       kInt32LaneKeys,
       "Highway AVX-512 (16 lanes, 6x4 microkernel): the same flash forward, backward and "
       "decode kernels as avx2 with 64 query rows per lane block",
       /*score_variants=*/true,
       /*automatic=*/true,
       kAvx512DecodeTuning},
      {Isa::neon,
       [](const CpuFeatures& f) { return f.neon; },
       {{"attention_fwd_f32_neon", attention_fwd_f32_neon},
        {"attention_fwd_bf16_neon", attention_fwd_bf16_neon},
        {"attention_fwd_f16_neon", attention_fwd_f16_neon}},
       {{"attention_bwd_f32_neon", attention_bwd_f32_neon},
        {"attention_bwd_bf16_neon", attention_bwd_bf16_neon},
        {"attention_bwd_f16_neon", attention_bwd_f16_neon}},
       {{"attention_decode_f32_neon", attention_decode_f32_neon},
        {"attention_decode_bf16_neon", attention_decode_bf16_neon},
        {"attention_decode_f16_neon", attention_decode_f16_neon},
        {"attention_decode_int8_neon", attention_decode_int8_neon},
        {"attention_decode_fp8_e4m3_neon", attention_decode_fp8_e4m3_neon}},
       kInt32LaneKeys,
       "Highway NEON, AArch64 Advanced SIMD (4 lanes, 6x4 microkernel): the same flash forward, "
       "backward and decode kernels as avx2 with 16 query rows per lane block; bf16/f16 caches "
       "widened exactly in registers (shift / FCVTL)",
       /*score_variants=*/true,
       /*automatic=*/true,
       kNoDecodeTuning},
      {Isa::avx512_bf16,
       [](const CpuFeatures& f) { return f.avx512_bf16; },
       {{"attention_fwd_f32_avx512", attention_fwd_f32_avx512},
        {"attention_fwd_bf16_avx512bf16", attention_fwd_bf16_avx512bf16},
        {"attention_fwd_f16_avx512", attention_fwd_f16_avx512}},
       {{"attention_bwd_f32_avx512", attention_bwd_f32_avx512},
        {"attention_bwd_bf16_avx512bf16", attention_bwd_bf16_avx512bf16},
        {"attention_bwd_f16_avx512", attention_bwd_f16_avx512}},
       {{"attention_decode_f32_avx512", attention_decode_f32_avx512},
        {"attention_decode_bf16_avx512", attention_decode_bf16_avx512},
        {"attention_decode_f16_avx512", attention_decode_f16_avx512},
        {"attention_decode_int8_avx512", attention_decode_int8_avx512},
        {"attention_decode_fp8_e4m3_avx512", attention_decode_fp8_e4m3_avx512}},
       kInt32LaneKeys,
       "avx512 plus AVX512-BF16: the bf16 forward's Q K^T and P V products on vdpbf16ps (bf16 "
       "pairs, fp32 accumulation; P rounded to bf16 before P V, intrinsics in their own "
       "translation unit), and the bf16 backward's recomputed S = Q K^T and dP = dO V^T (exact "
       "bf16 products; dV, dK, dQ in fp32 as avx512's); every other kernel is the avx512 one. "
       "Automatic on AMD Zen 4 and Zen 5, where this forward measured 1.3x faster than avx512's "
       "widening one; opt-in elsewhere: on Intel Xeon (Emerald Rapids, no AMX) vdpbf16ps runs at "
       "half the FMA issue rate and it is 1.7x slower (docs/performance.md, D-bf16-2, D-bf16-7, "
       "D-bf16-8)",
       /*score_variants=*/true,
       /*automatic=*/false,
       kAvx512DecodeTuning,
       /*preferred_on=*/&detail::bf16_products_preferred},
  }};
}

[[noreturn]] void missing(const char* entry, const char* op, Isa isa, DType dtype) {
  throw UnsupportedError(std::string(entry) + ": the " + to_string(isa) + " path has no " + op +
                         " kernel for dtype " + to_string(dtype) +
                         (kernel_set(isa).compiled() ? "" : " (not built into this binary)"));
}

// The score-variant gate (registry.hpp): no silent fallback to another set.
template <class Fn>
NamedKernel<Fn> gate(NamedKernel<Fn> kernel, const char* entry, Isa isa,
                     std::string_view variants) {
  if (!variants.empty() && !kernel_set(isa).score_variants) {
    throw UnsupportedError(std::string(entry) + ": the kernel " + kernel.name + " (" +
                           to_string(isa) + " path) does not support the score variants used (" +
                           std::string(variants) +
                           "); force another path with options.isa (isa=portable supports them)");
  }
  return kernel;
}

template <class Fn>
NamedKernel<Fn> pick(const NamedKernel<Fn> (&column)[kDTypeCount], const char* entry,
                     const char* op, Isa isa, DType dtype) {
  const auto i = static_cast<std::size_t>(dtype);
  if (i >= kDTypeCount || column[i].fn == nullptr) missing(entry, op, isa, dtype);
  return column[i];
}

}  // namespace

std::span<const KernelSet> kernel_sets() {
  static const std::array<KernelSet, 5> sets = make_sets();
  return sets;
}

const KernelSet& kernel_set(Isa isa) {
  for (const KernelSet& s : kernel_sets()) {
    if (s.isa == isa) return s;
  }
  throw UnsupportedError(std::string("tokenmix: no kernel set for isa '") + to_string(isa) + "'");
}

NamedKernel<ForwardKernel> select_forward(const char* entry, Isa isa, DType dtype, std::int64_t tk,
                                          std::string_view variants) {
  if (tk > kernel_set(isa).max_keys) isa = Isa::portable;  // the T_k rule (registry.hpp)
  return gate(pick(kernel_set(isa).forward, entry, "forward", isa, dtype), entry, isa, variants);
}

NamedKernel<BackwardKernel> select_backward(const char* entry, Isa isa, DType dtype,
                                            std::int64_t tk, std::string_view variants) {
  if (tk > kernel_set(isa).max_keys) isa = Isa::portable;  // the T_k rule (registry.hpp)
  return gate(pick(kernel_set(isa).backward, entry, "backward", isa, dtype), entry, isa, variants);
}

NamedKernel<DecodeKernel> select_decode(const char* entry, Isa isa, DType cache_dtype) {
  const int i = cache_column(cache_dtype);
  const NamedKernel<DecodeKernel>* column = kernel_set(isa).decode;
  if (i < 0 || column[i].fn == nullptr) missing(entry, "decode", isa, cache_dtype);
  return column[i];
}

}  // namespace tokenmix::kernels
