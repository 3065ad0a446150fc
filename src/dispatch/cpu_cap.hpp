// src/dispatch/cpu_cap.hpp — internal: CPU features as capped by TOKENMIX_CPU_CAP, with errors
// naming the calling entry point (runtime.hpp documents the variable).
#pragma once

#include "dispatch/registry.hpp"
#include "tokenmix/runtime.hpp"

namespace tokenmix::detail {

/// TOKENMIX_CPU_CAP, read now: Isa::automatic when unset or empty (no cap), else the highest
/// path whose CPU features the library may see. ArgumentError naming `fn` on another value.
Isa cpu_cap(const char* fn);

/// cpu_features() under the cap read now (one read per call; errors name `fn`).
const CpuFeatures& cpu_features(const char* fn);

/// Decode over an fp8 E4M3 cache on AVX-512: widen the codes straight into fp32 bits
/// (kernels::DecodeArgs::fp8_direct; no conversion instruction, subnormal fp32 operands) rather
/// than through f16 bits. TOKENMIX_FP8_WIDEN, read now: `direct` or `f16` forces the choice;
/// unset or empty: fp8_direct_preferred for this CPU's vendor and family. The portable and NEON
/// paths always read f16 bits or the scalar decoding. ArgumentError naming `fn` on another value.
bool fp8_direct_widening(const char* fn);

/// The automatic choice of fp8_direct_widening for a CPU (`amd`: vendor AuthenticAMD; `family`:
/// CPUID's display family, base + extended): true on the CPUs the direct reading was measured
/// faster on, AMD family 19h (Zen 4, both x86 paths) and 1Ah (Zen 5, both x86 paths;
/// docs/performance.md, D-fp8-6). Zen 3 (19h, AVX2 only) not measured; Intel keeps the f16 reading:
/// there an FMA with a subnormal operand takes a microcode assist, and a cache of mostly
/// subnormal codes read directly ran 100× slower (a Xeon of family 6 model 207, D-fp8-7).
bool fp8_direct_preferred(bool amd, unsigned family);

/// The CPUs on which Isa::automatic picks the opt-in avx512_bf16 path (KernelSet::preferred_on;
/// `amd`: vendor AuthenticAMD, `family`: CPUID's display family): AMD family 19h (Zen 4) and 1Ah
/// (Zen 5), where `vdpbf16ps` issues at the FMA rate and the bf16 forward on it measured 1.3×
/// faster than the widening one (docs/performance.md, D-bf16-2, D-bf16-7). Intel keeps avx512:
/// on a Xeon of family 6 model 207 it ran 1.7× slower. Zen 3 (19h) has no AVX512-BF16, so the
/// path cannot run there.
bool bf16_products_preferred(bool amd, unsigned family);

/// Isa::automatic may pick `set` on this CPU: KernelSet::automatic, or its preferred_on for this
/// CPU's vendor and family.
bool automatic_may_pick(const kernels::KernelSet& set);

/// Decode on AVX-512 and AVX2: prefetch every cache dtype's next tile pair in address order
/// (kernels::DecodeArgs::linear_prefetch), not only those the path's per-dtype choice takes that
/// way. TOKENMIX_LINEAR_PREFETCH, read now: `all` or `per-dtype` forces the choice; unset or
/// empty: linear_prefetch_preferred for this CPU's vendor. ArgumentError naming `fn` on another
/// value.
bool linear_decode_prefetch(const char* fn);

/// The automatic choice of linear_decode_prefetch (`intel`: vendor GenuineIntel): true on Intel,
/// where address order measured faster for every cache dtype on both x86 paths (a Xeon of family
/// 6 model 207, docs/performance.md, D-prefetch-6); false elsewhere (AMD Zen 3, Zen 4 and Zen 5:
/// the per-dtype choices measured there).
bool linear_prefetch_preferred(bool intel);

/// Decode over an int8, fp8_e4m3 or bf16 cache (`cache`) on the avx512 paths: run the per-tile
/// products of units of ≥ 16 rows (bf16: where they pay) on AMX tiles (kernels::DecodeArgs::amx,
/// simd/amx_decode.hpp). `path_has_amx`: the path the call runs has them (its registry entry
/// KernelSet::decode_tunables: the avx512 paths of a build with AMX; `path` names the one it
/// runs). TOKENMIX_DECODE_AMX, read now: `off` never; `on` requires it (UnsupportedError naming
/// `fn` where it cannot run: the CPU lacks the features, no Linux grant, or another path); unset or
/// empty: where the path has it, cpu_features(fn).amx_int8 (int8) or amx_bf16 (fp8, bf16) holds
/// (TOKENMIX_CPU_CAP=avx512 hides them) and Linux grants this process the tile data (asked here,
/// once). ArgumentError naming `fn` on another value of the switch or another cache dtype.
/// `tiles_fit` false (an int8 cache in rows, not quads): never (`on`: UnsupportedError).
bool decode_amx(const char* fn, bool path_has_amx, const char* path, DType cache,
                bool tiles_fit = true);

/// What runs for one decode call, decided once, in one place, when its path is resolved: the
/// kernel of (path, cache dtype) from the registry and the three per-CPU choices of the decode
/// wing (each documented above, each printed by `tokenmix info`). `int8_quads`: the cache's int8
/// tiles are VNNI-4 quads (KVCache::int8_quads), without which an int8 cache has no tile products.
/// Throws what select_decode and the three switches throw, naming `fn`.
struct DecodeChoice {
  kernels::NamedKernel<kernels::DecodeKernel> kernel;
  bool fp8_direct = false;       ///< kernels::DecodeArgs::fp8_direct (fp8_direct_widening)
  bool linear_prefetch = false;  ///< kernels::DecodeArgs::linear_prefetch (linear_decode_prefetch)
  bool amx = false;              ///< kernels::DecodeArgs::amx (decode_amx)
};
DecodeChoice choose_decode(const char* fn, Isa isa, DType cache, bool int8_quads);

}  // namespace tokenmix::detail
