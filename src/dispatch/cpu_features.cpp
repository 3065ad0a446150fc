// src/dispatch/cpu_features.cpp — what the CPU and the OS support.
//
// CPUID alone is not enough: the OS must also save the wider register state on context switch
// (XCR0 bits, read with XGETBV), or AVX/AVX-512 instructions fault. AMX additionally needs the
// Linux ARCH_REQ_XCOMP_PERM request per process before any tile instruction; we only report it.
//
// On AArch64 the kernel reports the CPU's features in the auxiliary vector (getauxval(AT_HWCAP));
// Advanced SIMD is architecturally mandatory there, but we read its bit (and those of the
// "crypto" extension Highway's NEON target is compiled with, "+crypto") rather than assume it.
//
// TOKENMIX_CPU_CAP (= portable | avx2 | avx512) hides features above a path, so the library
// behaves exactly as on a CPU that lacks them: avx2 clears AVX-512, AVX-512 BF16 and AMX;
// portable clears everything (NEON too: as on a CPU without SIMD); avx512 clears AMX. NEON
// ranks with avx2 (runtime.hpp), so avx2 and avx512 leave it.
#include <array>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>

#include "dispatch/cpu_cap.hpp"
#include "tokenmix/error.hpp"
#include "tokenmix/runtime.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#define TOKENMIX_X86 1
#elif defined(__aarch64__) && defined(__linux__)
#include <asm/hwcap.h>
#include <sys/auxv.h>
#define TOKENMIX_AARCH64_LINUX 1
#endif

namespace tokenmix {
namespace {

#ifdef TOKENMIX_X86
std::uint64_t read_xcr0() {
  std::uint32_t eax = 0, edx = 0;
  __asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
  return (static_cast<std::uint64_t>(edx) << 32) | eax;
}

CpuFeatures detect() {
  CpuFeatures f;
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_max(0x80000000u, nullptr) >= 0x80000004u) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      __get_cpuid(0x80000002u + i, &a, &b, &c, &d);
      const unsigned regs[4] = {a, b, c, d};
      for (int r = 0; r < 4; ++r)
        for (int byte = 0; byte < 4; ++byte)
          brand[i * 16 + r * 4 + byte] = static_cast<char>((regs[r] >> (8 * byte)) & 0xff);
    }
    f.model = brand;
    const auto first = f.model.find_first_not_of(' ');
    f.model = first == std::string::npos ? "" : f.model.substr(first);
    while (!f.model.empty() && (f.model.back() == ' ' || f.model.back() == '\0'))
      f.model.pop_back();
  }
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = (c >> 27) & 1, avx = (c >> 28) & 1, fma = (c >> 12) & 1;
  if (!osxsave || !avx) return f;
  const std::uint64_t xcr0 = read_xcr0();
  const bool ymm_state = (xcr0 & 0x6) == 0x6;           // SSE + AVX state
  const bool zmm_state = (xcr0 & 0xe6) == 0xe6;         // + opmask, ZMM_Hi256, Hi16_ZMM
  const bool tile_state = (xcr0 & 0x60000) == 0x60000;  // XTILECFG + XTILEDATA
  if (__get_cpuid_max(0, nullptr) < 7) return f;
  __cpuid_count(7, 0, a, b, c, d);
  const bool avx2 = (b >> 5) & 1;
  const bool avx512f = (b >> 16) & 1, avx512dq = (b >> 17) & 1, avx512bw = (b >> 30) & 1,
             avx512vl = (b >> 31) & 1;
  const bool amx_tile = (d >> 24) & 1, amx_int8 = (d >> 25) & 1, amx_bf16 = (d >> 22) & 1;
  const bool avx512_vbmi = (c >> 1) & 1;
  f.avx2_fma = ymm_state && avx2 && fma;
  f.avx512f = f.avx2_fma && zmm_state && avx512f && avx512dq && avx512bw && avx512vl;
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  __cpuid_count(7, 1, a1, b1, c1, d1);
  f.avx512_bf16 = f.avx512f && ((a1 >> 5) & 1);
  f.amx_tile = tile_state && amx_tile;
  f.amx_int8 = f.amx_tile && amx_int8 && f.avx512f;
  f.amx_bf16 = f.amx_int8 && amx_bf16 && f.avx512_bf16 && avx512_vbmi;
  return f;
}
#else
CpuFeatures detect() {
  CpuFeatures f;
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line)) {
    const auto colon = line.find(':');
    if (colon == std::string::npos) continue;
    const std::string key = line.substr(0, line.find_first_of(" \t"));
    if (key == "model" || key == "Model" || key == "CPU") {
      f.model = line.substr(colon + 2);
      if (key == "Model") break;
    }
  }
#ifdef TOKENMIX_AARCH64_LINUX
  const unsigned long hw = getauxval(AT_HWCAP);
  constexpr unsigned long kCrypto = HWCAP_AES | HWCAP_PMULL | HWCAP_SHA1 | HWCAP_SHA2;
  f.neon = (hw & HWCAP_ASIMD) != 0 && (hw & kCrypto) == kCrypto;
#endif
  return f;
}
#endif

}  // namespace

std::vector<std::string> CpuFeatures::flags() const {
  std::vector<std::string> out;
  if (avx2_fma) out.emplace_back("avx2+fma");
  if (avx512f) out.emplace_back("avx512f/bw/dq/vl");
  if (avx512_bf16) out.emplace_back("avx512_bf16");
  if (amx_tile) out.emplace_back("amx-tile");
  if (amx_int8) out.emplace_back("amx-int8");
  if (amx_bf16) out.emplace_back("amx-bf16");
  if (neon) out.emplace_back("neon(asimd+crypto)");
  return out;
}

namespace {

const CpuFeatures& detected() {
  static const CpuFeatures features = detect();
  return features;
}

CpuFeatures capped(Isa cap) {
  CpuFeatures f = detected();
  if (cap == Isa::automatic) return f;
  f.amx_tile = f.amx_int8 = f.amx_bf16 = false;
  if (cap == Isa::avx512) return f;
  f.avx512f = f.avx512_bf16 = false;
  if (cap == Isa::avx2) return f;
  f.avx2_fma = false;
  f.neon = false;
  return f;
}

// A two-valued environment switch: `on` → true, `off` → false, unset or empty → nullopt (the
// automatic choice); anything else an ArgumentError naming `fn`, the variable, its values and
// what it was.
std::optional<bool> env_switch(const char* fn, const char* var, const char* on, const char* off) {
  const char* env = std::getenv(var);
  if (env == nullptr || *env == '\0') return std::nullopt;
  if (std::strcmp(env, on) == 0) return true;
  if (std::strcmp(env, off) == 0) return false;
  throw ArgumentError(ErrorCode::invalid_argument,
                      std::string(fn) + ": environment variable " + var + " must be one of " + on +
                          ", " + off + " (or unset/empty for the automatic choice); got '" + env +
                          "'");
}

// CPUID's vendor (leaf 0) and display family (leaf 1: base + extended), read once; all false and
// 0 off x86 or where CPUID fails.
struct CpuVendor {
  bool amd = false, intel = false;
  unsigned family = 0;
};

const CpuVendor& cpu_vendor() {
  static const CpuVendor vendor = [] {
    CpuVendor v;
#ifdef TOKENMIX_X86
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return v;
    v.amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u;    // "AuthenticAMD"
    v.intel = b == 0x756e6547u && d == 0x49656e69u && c == 0x6c65746eu;  // "GenuineIntel"
    if (!__get_cpuid(1, &a, &b, &c, &d)) return v;
    const unsigned base = (a >> 8) & 0xfu, ext = (a >> 20) & 0xffu;
    v.family = base == 0xfu ? base + ext : base;
#endif
    return v;
  }();
  return vendor;
}

// Linux gives a process the AMX tile data only on request (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA, 18; granted per process). Asked once, the first time decode would use AMX,
// not at detection: the grant enlarges the process's signal frames.
bool amx_permission() {
#if defined(TOKENMIX_X86) && defined(__linux__)
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
#else
  return false;
#endif
}

}  // namespace

namespace detail {

Isa cpu_cap(const char* fn) {
  const char* env = std::getenv("TOKENMIX_CPU_CAP");
  if (env == nullptr || *env == '\0') return Isa::automatic;
  for (Isa i : {Isa::portable, Isa::avx2, Isa::avx512}) {
    if (std::strcmp(env, to_string(i)) == 0) return i;
  }
  throw ArgumentError(ErrorCode::invalid_argument,
                      std::string(fn) +
                          ": environment variable TOKENMIX_CPU_CAP must be one of portable, avx2, "
                          "avx512 (or unset/empty for no cap); got '" +
                          env + "'");
}

bool fp8_direct_preferred(bool amd, unsigned family) {
  // AMD family 19h (Zen 3, Zen 4) and 1Ah (Zen 5): measured faster on Zen 4's avx512 path and its
  // avx2 path forced (D-fp8-2, D-fp8-3), and on Zen 5's (T_new = 1, one thread, hot: 0.200 → 0.170
  // ms on avx512, 0.367 → 0.336 on avx2; D-fp8-6). Zen 3 (AVX2 only) not measured.
  return amd && (family == 0x19u || family == 0x1Au);
}

bool fp8_direct_widening(const char* fn) {
  if (const auto forced = env_switch(fn, "TOKENMIX_FP8_WIDEN", "direct", "f16")) return *forced;
  return fp8_direct_preferred(cpu_vendor().amd, cpu_vendor().family);
}

bool bf16_products_preferred(bool amd, unsigned family) {
  // Two threads, bf16, B = 1, H 16/4, d_h 128, causal, forward (D-bf16-2, D-bf16-7): Zen 4
  // 199.8 → 148.8 ms at T = 2048; Zen 5 T = 2048 / 4096 49.6 → 37.1, 191.6 → 141.4 ms.
  return amd && (family == 0x19u || family == 0x1Au);
}

bool automatic_may_pick(const kernels::KernelSet& set) {
  return set.automatic ||
         (set.preferred_on != nullptr && set.preferred_on(cpu_vendor().amd, cpu_vendor().family));
}

bool linear_prefetch_preferred(bool intel) {
  // Intel Xeon (family 6 model 207), two threads, T_k = 32768, the cache read from memory, fastest
  // of 7 steps in three interleaved rounds: bf16 T_new = 2 / 4 / 8 / 16 6.05 → 4.89, 8.8 → 7.84,
  // 14.2 → 13.3, 26.5 → 25.3 ms; f16 T_new = 2 5.97 → 4.91; fp8 T_new = 1 3.15 → 2.94; int8
  // T_new = 1 / 4 2.78 → 2.71, 7.35 → 7.33; T_new = 1 bf16 and f16 within noise. The AVX2 path
  // forced: int8 T_new = 1 / 2 / 4 4.25 → 3.40, 7.35 → 6.41, 13.05 → 12.22 ms, fp8 T_new = 1 / 4
  // 4.91 → 3.97, 14.95 → 14.17 (D-prefetch-6).
  return intel;
}

bool linear_decode_prefetch(const char* fn) {
  if (const auto forced = env_switch(fn, "TOKENMIX_LINEAR_PREFETCH", "all", "per-dtype")) {
    return *forced;
  }
  return linear_prefetch_preferred(cpu_vendor().intel);
}

bool decode_amx(const char* fn, bool path_has_amx, const char* path, DType cache, bool tiles_fit) {
  if (cache != DType::int8 && cache != DType::fp8_e4m3 && cache != DType::bf16) {
    throw ArgumentError(ErrorCode::invalid_argument,
                        std::string(fn) +
                            ": cache_dtype must be int8, fp8_e4m3 or bf16 (the caches with AMX "
                            "tile products); got " +
                            to_string(cache));
  }
  const auto forced = env_switch(fn, "TOKENMIX_DECODE_AMX", "on", "off");
  if (forced && !*forced) return false;
  const bool int8 = cache == DType::int8;
  const char* features =
      int8 ? "AMX-INT8" : "AMX-BF16 (with AMX-INT8, AVX512-BF16, AVX512-VBMI)";  // fp8, bf16
  if (!tiles_fit) {
    if (forced) {
      throw UnsupportedError(std::string(fn) +
                             ": TOKENMIX_DECODE_AMX=on, but this int8 cache holds plain rows "
                             "(KVCacheConfig::int8_quads false); AMX-INT8 takes VNNI-4 quads");
    }
    return false;
  }
  if (!path_has_amx) {
    if (forced) {
      throw UnsupportedError(std::string(fn) + ": TOKENMIX_DECODE_AMX=on, but this call runs the " +
                             path +
                             " path, whose decode kernels have no AMX tile products (the avx512 "
                             "paths of a build with AMX have them)");
    }
    return false;
  }
  // int8 and fp8 caches quantize K per channel over each closed 64-key tile (SPEC "Quantized KV
  // cache"): the AMX tile products take the unit's query rows as planes once per unit and one
  // scale per key row, so they cannot fold the channel scales into the rows per tile. These
  // caches run the FMA products on every path; `on` is refused, never ignored (docs/performance.md,
  // D-kv-3).
  if (cache != DType::bf16) {
    if (forced) {
      throw UnsupportedError(std::string(fn) +
                             ": TOKENMIX_DECODE_AMX=on, but the AMX tile "
                             "products do not read a " +
                             to_string(cache) +
                             " cache (K quantized per channel per 64-key tile, SPEC \"Quantized "
                             "KV cache\"); only a bf16 cache runs on them");
    }
    return false;
  }
  const bool has = int8 ? cpu_features(fn).amx_int8 : cpu_features(fn).amx_bf16;
  const bool usable = has && amx_permission();
  if (forced && !usable) {
    throw UnsupportedError(
        std::string(fn) + ": TOKENMIX_DECODE_AMX=on, but " + features + " cannot run here (" +
        to_string(cache) + " cache: " +
        (has ? "Linux refused this process the AMX tile data (arch_prctl)"
             : std::string("the CPU, the OS or TOKENMIX_CPU_CAP gives no ") + features) +
        ")");
  }
  return usable;
}

const CpuFeatures& cpu_features(const char* fn) {
  // One immutable copy per cap (index = the Isa value; automatic = no cap), built once.
  static const std::array<CpuFeatures, 4> by_cap = {capped(Isa::automatic), capped(Isa::portable),
                                                    capped(Isa::avx2), capped(Isa::avx512)};
  return by_cap[static_cast<std::size_t>(cpu_cap(fn))];
}

}  // namespace detail

const CpuFeatures& cpu_features() {
  return detail::cpu_features("cpu_features");
}

Isa cpu_cap() {
  return detail::cpu_cap("cpu_cap");
}

bool fp8_direct_widening() {
  return detail::fp8_direct_widening("fp8_direct_widening");
}

bool linear_decode_prefetch() {
  return detail::linear_decode_prefetch("linear_decode_prefetch");
}

bool decode_amx(DType cache_dtype) {
  return detail::decode_amx("decode_amx", true, "avx512", cache_dtype);
}

}  // namespace tokenmix
