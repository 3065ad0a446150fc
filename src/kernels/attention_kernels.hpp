// src/kernels/attention_kernels.hpp — the internal interface between the public API (which
// validates and dispatches) and the kernels (which compute). Everything here is already
// checked: shapes agree, pointers are valid, sizes fit, outputs do not alias inputs.
#pragma once

#include <cstdint>

#include "tokenmix/attention.hpp"

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

}  // namespace tokenmix::kernels
