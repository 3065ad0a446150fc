// src/kernels/simd/attention_bwd_bf16_hwy.cpp — the flash backward over bf16 activations (widened
// to fp32 on pack, gradients rounded once on store): AttentionBwdT<bf16_t> (attention_bwd-inl.h),
// compiled once per target and exported as attention_bwd_bf16_avx512 / _avx2 / _neon
// (dispatch/registry.cpp). One file per dtype, so the three compile in parallel. On the AVX-512
// target also AttentionBwdT<bf16_t, true>, exported as attention_bwd_bf16_avx512bf16 (path
// avx512_bf16: S and dP on vdpbf16ps, dpbf16.hpp; D-bf16-8). The includes below must follow
// foreach_target.h, in order.
// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "kernels/simd/attention_bwd_bf16_hwy.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"
#include "kernels/simd/attention_bwd-inl.h"
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {
#if HWY_TARGET == HWY_AVX3
void AttentionBwdDpBf16(const BackwardArgs& args) {  // path avx512_bf16
  AttentionBwdT<bf16_t, true>(args);
}
#endif
}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace tokenmix::kernels {
TOKENMIX_BWD_KERNELS(bf16, bf16_t);
// AVX512-BF16 products (dpbf16.hpp) inside the AVX-512 kernel: x86-64 builds only.
#if (HWY_TARGETS & HWY_AVX3) && TOKENMIX_HAVE_DPBF16
const BackwardKernel attention_bwd_bf16_avx512bf16 = &N_AVX3::AttentionBwdDpBf16;
#else
const BackwardKernel attention_bwd_bf16_avx512bf16 = nullptr;
#endif
}  // namespace tokenmix::kernels
#endif  // HWY_ONCE
