// src/kernels/simd/attention_decode_int8_hwy.cpp — decode over an int8 cache:
// DecodeUnits<Int8Reader<std::int8_t>> (decode_skeleton-inl.h with decode_reader_int8-inl.h),
// compiled once per target and exported as attention_decode_int8_avx512 / _avx2 / _neon
// (dispatch/registry.cpp). One file per cache dtype: a new dtype is its reader policy, one such
// file and a registry line. The includes below must follow foreach_target.h, in order.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/simd/attention_decode_int8_hwy.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
// clang-format: the includes below must follow foreach_target.h
#include "hwy/highway.h"
#include "kernels/simd/decode_reader_int8-inl.h"
#include "kernels/simd/decode_skeleton-inl.h"
// clang-format on

#if HWY_ONCE
namespace tokenmix::kernels {
TOKENMIX_DECODE_KERNELS(int8, Int8Reader<std::int8_t>);
}  // namespace tokenmix::kernels
#endif  // HWY_ONCE
