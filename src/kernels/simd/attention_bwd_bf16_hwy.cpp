// src/kernels/simd/attention_bwd_bf16_hwy.cpp — the flash backward over bf16 activations (widened
// to fp32 on pack, gradients rounded once on store): AttentionBwdT<bf16_t> (attention_bwd-inl.h),
// compiled once per target and exported as attention_bwd_bf16_avx512 / _avx2 / _neon
// (dispatch/registry.cpp). One file per dtype, so the three compile in parallel. The includes below
// must follow foreach_target.h, in order.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/simd/attention_bwd_bf16_hwy.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/simd/attention_bwd-inl.h"
// clang-format on

#if HWY_ONCE
namespace tokenmix::kernels {
TOKENMIX_BWD_KERNELS(bf16, bf16_t);
}  // namespace tokenmix::kernels
#endif  // HWY_ONCE
