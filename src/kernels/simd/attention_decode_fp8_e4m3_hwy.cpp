// src/kernels/simd/attention_decode_fp8_e4m3_hwy.cpp — decode over an fp8 E4M3 cache:
// DecodeUnits<Fp8Reader<fp8_e4m3_t>> (decode_skeleton-inl.h with decode_reader_fp8-inl.h),
// compiled once per target and exported as attention_decode_fp8_e4m3_avx512 / _avx2 / _neon
// (dispatch/registry.cpp). One file per cache dtype: a new dtype is its reader policy, one such
// file and a registry line. The includes below must follow foreach_target.h, in order.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/simd/attention_decode_fp8_e4m3_hwy.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// clang-format: the includes below must follow foreach_target.h
#include "hwy/highway.h"
#include "kernels/simd/decode_reader_fp8-inl.h"
#include "kernels/simd/decode_skeleton-inl.h"
// clang-format on

#if HWY_ONCE
namespace tokenmix::kernels {
TOKENMIX_DECODE_KERNELS(fp8_e4m3, Fp8Reader<fp8_e4m3_t>);
}  // namespace tokenmix::kernels
#endif  // HWY_ONCE
