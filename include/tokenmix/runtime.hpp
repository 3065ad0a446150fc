// tokenmix/runtime.hpp — which kernels run: CPU feature detection, ISA choice and threads.
//
// The kernel path is chosen once per public call from what the CPU *and* the OS support
// (x86: CPUID plus XCR0 for AVX/AVX-512 state; AArch64: the kernel's HWCAP bits). Callers may
// force a lower path with AttentionOptions::isa or the environment variable TOKENMIX_ISA
// (= auto | portable | avx2 | avx512 | avx512_bf16 | neon); asking for a path this build or CPU
// cannot run throws UnsupportedError (naming the entry point) rather than crashing with an illegal
// instruction. An x86 build has no neon kernels and an AArch64 build no avx2/avx512 kernels:
// forcing one of them throws UnsupportedError saying the build lacks it.
//
// The environment variable TOKENMIX_CPU_CAP (= portable | avx2 | avx512; unset or empty = no
// cap) caps the CPU features the library detects, e.g. to test the AVX2 path on an AVX-512
// machine: with `avx2` the library behaves exactly as on a CPU without AVX-512 (cpu_features()
// reports no AVX-512/BF16/AMX, available_isas() lacks avx512, forcing avx512 throws
// UnsupportedError); with `portable` as on a CPU without any SIMD path (x86 features and NEON
// hidden); `avx512` hides AMX. The cap is an ordered level, portable < avx2 < avx512, and neon
// ranks with avx2 (each architecture's first SIMD level): `portable` hides it, `avx2` and
// `avx512` leave it. It is read at every call that looks at CPU features (so setenv before a
// call takes effect); another value throws ArgumentError naming TOKENMIX_CPU_CAP and the
// allowed values.
#pragma once

#include <string>
#include <vector>

#include "tokenmix/tensor.hpp"

namespace tokenmix {

/// Instruction-set paths. `automatic` means "the best available" (the highest runnable path that is
/// not opt-in: avx512_bf16 is opt-in, see below). portable runs everywhere;
/// avx2/avx512 are x86-64 paths, neon (AArch64 Advanced SIMD, 128-bit) the ARM one; values
/// are stable (neon was appended).
/// avx512_bf16 is avx512 plus AVX512-BF16 (`vdpbf16ps`) for the bf16 forward's products; it
/// needs CpuFeatures::avx512_bf16 (TOKENMIX_CPU_CAP=avx2 or portable hides it). Opt-in only
/// (TOKENMIX_ISA / options.isa): on the Intel Xeon it was measured on, its bf16 forward is
/// slower than avx512's widening one (docs/performance.md, D-bf16-2).
enum class Isa { automatic = 0, portable = 1, avx2 = 2, avx512 = 3, neon = 4, avx512_bf16 = 5 };

const char* to_string(Isa isa) noexcept;
/// Parses "auto", "portable", "avx2", "avx512", "neon", "avx512_bf16" (throws ArgumentError
/// naming `what` otherwise).
Isa parse_isa(const std::string& text, const char* what = "isa");

/// What this CPU and OS support (independent of what this build compiled).
struct CpuFeatures {
  std::string model;      ///< e.g. "AMD EPYC 9R14" (from CPUID brand string or /proc/cpuinfo)
  bool avx2_fma = false;  ///< AVX2 + FMA + OS saves YMM state
  bool avx512f = false;   ///< AVX-512F/BW/DQ/VL + OS saves ZMM/opmask state
  bool avx512_bf16 = false;
  bool amx_tile =
      false;  ///< AMX-TILE reported by CPUID (use also needs a Linux permission request)
  bool amx_int8 = false;  ///< amx_tile + AMX-INT8 + AVX-512 F/BW/DQ/VL (CPUID), tile state saved
  /// amx_int8 + AMX-BF16 + AVX512-BF16 + AVX512-VBMI (CPUID): what decode's tile products over an
  /// fp8 or a bf16 cache use (decode_amx)
  bool amx_bf16 = false;
  /// AArch64 Advanced SIMD (HWCAP_ASIMD) and the AES/PMULL/SHA1/SHA2 "crypto" extension
  /// (HWCAP_AES|PMULL|SHA1|SHA2) that Highway's NEON target is compiled with.
  bool neon = false;
  std::vector<std::string> flags() const;  ///< names of the features above that are present
};
/// Detected once; the TOKENMIX_CPU_CAP cap (read at each call) is applied on top.
const CpuFeatures& cpu_features();

/// The TOKENMIX_CPU_CAP cap now in effect: Isa::automatic when there is none, else the highest
/// path whose CPU features the library may see. Throws ArgumentError on an invalid value.
Isa cpu_cap();

/// How decode over an fp8 E4M3 KV cache widens its codes on the avx512 and avx2 paths: true =
/// straight into fp32 bits (no conversion instruction; subnormal fp32 operands, so a worker thread
/// whose MXCSR sets DAZ or FTZ reads through f16 bits instead), false = through f16 bits (F16C).
/// Same results either way (bitwise while no product is subnormal). TOKENMIX_FP8_WIDEN=direct|f16
/// forces it; unset or empty: direct on AMD family 19h and 1Ah (Zen 3, Zen 4 and Zen 5; measured
/// faster on Zen 4 and Zen 5, on both paths), f16 elsewhere (on Intel an FMA with a subnormal
/// operand takes a microcode assist: a cache of mostly subnormal codes read directly ran 100×
/// slower). portable and neon ignore it. Throws ArgumentError on another value.
bool fp8_direct_widening();

/// Which KV caches the avx512 and avx2 decode kernels prefetch in address order (the next K and V
/// tile pair front to back as one byte range) rather than row by row where their products read:
/// true = every cache dtype, false = each path's per-dtype choice (avx512: the fp32 cache only;
/// avx2: all but int8 and fp8). Same results either way (only the prefetches differ).
/// TOKENMIX_LINEAR_PREFETCH=all|per-dtype forces it; unset or empty: all on Intel CPUs (measured
/// faster there: avx512 bf16 and f16 steps of several tokens 5–19 %, one-token fp8 and int8 steps
/// 2–5 %; avx2 int8 and fp8 one-token steps 20 %), per-dtype elsewhere (AMD: the cursor measured
/// slower for int8 and fp8). portable and neon ignore it. Throws ArgumentError on another value.
bool linear_decode_prefetch();

/// Whether decode over a `cache_dtype` KV cache (int8, fp8_e4m3 or bf16) on the avx512 paths runs
/// its per-tile products (S = Q Kᵀ, Õ += P V) on AMX tiles in work units of at least 16 rows
/// (query positions × the heads of a KV group, e.g. T_new ≥ 4 at 4 query heads per KV head; int8:
/// from 4 rows, T_new ≥ 1 there; bf16: from 32 rows, T_new ≥ 8 there, and not at 36 rows; d_h a
/// multiple of 64 up to 256). An int8 cache must hold its tiles in quads
/// (KVCacheConfig::int8_quads = true; rows are the default on every CPU); one in rows always takes
/// the FMA products.
/// - int8 (AMX-INT8, TDPBSSD / TDPBUSD): the fp32 query rows and the probabilities are written as
///   sums of integer planes (per row: within 2^−27 of the row's largest |element| for Q, 2^−23
///   for P); their products with the stored int8 elements are exact int32 sums.
/// - fp8_e4m3 (AMX-BF16, TDPBF16PS): every E4M3 value is a bf16 number, and the fp32 query rows
///   and probabilities are written exactly as sums of three bf16 planes; each plane's product is
///   an fp32 sum of exact products.
/// - bf16 (AMX-BF16, TDPBF16PS): the same planes against the stored values. A tile holding a
///   value the tiles would not take exactly goes to an exact fallback: a K tile with |k| ≥ 2^64,
///   ±∞ or NaN to the FMA products, a V tile with those or a subnormal to a scalar loop over each
///   row's visible keys (a masked key's NaN takes no part).
/// Either way results agree with the FMA products at fp32 rounding level, not bitwise. A unit
/// whose query rows hold a non-finite element, or whose largest |element| is outside
/// [2^−60, 2^60), takes the FMA products. TOKENMIX_DECODE_AMX=on|off forces it (`on` throws
/// UnsupportedError from a call that cannot use it: the CPU lacks the features, no Linux grant,
/// or a path other than avx512); unset or empty: on where CpuFeatures::amx_int8 (int8) or
/// amx_bf16 (fp8, bf16) holds, the OS saves tile state, TOKENMIX_CPU_CAP does not hide it, and
/// Linux grants the process the tile data (requested by this call, once). Throws ArgumentError on
/// another value, or for another cache_dtype.
bool decode_amx(DType cache_dtype = DType::int8);

/// Decode's per-CPU choices on one path, as attention_decode makes them for each call there: the
/// path's entry in the kernel registry says which choices its decode kernels have (portable and
/// neon: none of them; avx2: the fp8 widening and the prefetch order; avx512: also AMX), and the
/// CPU with the TOKENMIX_FP8_WIDEN / TOKENMIX_LINEAR_PREFETCH / TOKENMIX_DECODE_AMX switches picks
/// among those (fp8_direct_widening, linear_decode_prefetch, decode_amx above). `tokenmix info`
/// prints it for the resolved path.
struct DecodeTuning {
  Isa isa = Isa::portable;        ///< the resolved path these choices are for
  bool fp8_direct = false;        ///< an fp8 cache's codes widened straight into fp32 bits
  bool linear_prefetch = false;   ///< every cache dtype prefetched in address order
  std::string prefetch_by_dtype;  ///< the path's prefetch order per dtype otherwise
  bool amx_int8 = false;          ///< an int8 cache in quads: AMX-INT8 tile products
  bool amx_fp8 = false;           ///< an fp8 cache: AMX-BF16 tile products
  bool amx_bf16 = false;          ///< a bf16 cache: AMX-BF16 tile products
};
/// The decode tuning of path `isa` (automatic: the one resolve_isa picks) on this CPU. Throws what
/// resolve_isa and the three switches throw (TOKENMIX_DECODE_AMX=on where the path or the CPU has
/// no tile products: UnsupportedError).
DecodeTuning decode_tuning(Isa isa = Isa::automatic);

/// Paths compiled into this build and runnable on this CPU, lowest first (always has portable).
std::vector<Isa> available_isas();

/// Resolves a request: `automatic` → TOKENMIX_ISA if set, else the best available path. A
/// request that cannot run here throws UnsupportedError naming the entry point `fn`, what was
/// asked and what exists; a bad TOKENMIX_ISA / TOKENMIX_CPU_CAP throws ArgumentError.
Isa resolve_isa(Isa requested, const char* fn = "resolve_isa");

/// Threads used when an option says 0 (= "all"): OpenMP's default team size.
int default_threads();

/// One-line description of the kernels behind a path (their names, as in the kernel registry,
/// src/dispatch/registry.cpp), for `tokenmix info`.
std::string describe_kernel(Isa isa);

/// Library version, "MAJOR.MINOR.PATCH".
const char* version() noexcept;

}  // namespace tokenmix
