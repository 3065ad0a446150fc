// tests/unit/test_dispatch.cpp — the kernel registry (src/dispatch/registry.cpp), the CPU cap
// TOKENMIX_CPU_CAP (runtime.hpp), entry-point names in ISA errors, and ResourceError from the
// kernels' one allocation function (src/kernels/scratch_arena.hpp).
//
// The cap tests run on any CPU: each checks what the cap promises relative to what this CPU
// has (e.g. with TOKENMIX_CPU_CAP=avx2, avx512 is never available and auto resolves to the best
// path ≤ avx2), so they also exercise "a CPU without AVX-512" on an AVX-512 machine.
#include <gtest/gtest.h>
#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <string>
#include <vector>

#include "dispatch/cpu_cap.hpp"
#include "dispatch/registry.hpp"
#include "kernels/kv_tile_layout.hpp"
#include "kernels/scratch_arena.hpp"
#include "test_util.hpp"
#include "tokenmix/tokenmix.hpp"

#if defined(__SANITIZE_ADDRESS__)
// The ResourceError tests ask for petabytes on purpose; AddressSanitizer must report that as a
// failed allocation (null) instead of aborting, as the plain allocator does.
extern "C" const char* __asan_default_options() {
  return "allocator_may_return_null=1";
}
#endif

namespace tokenmix::testing {
namespace {

template <class E, class F>
void expect_error(F&& f, ErrorCode code, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "expected an exception";
  } catch (const E& e) {
    EXPECT_EQ(e.code(), code) << e.what();
    for (const std::string& part : parts) {
      EXPECT_NE(std::string(e.what()).find(part), std::string::npos)
          << "message lacks '" << part << "': " << e.what();
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong exception type: " << e.what();
  }
}

bool contains(const std::vector<Isa>& v, Isa isa) {
  return std::find(v.begin(), v.end(), isa) != v.end();
}

// What the uncapped CPU supports (read with no cap in effect).
CpuFeatures uncapped_features() {
  const ScopedEnv no_cap("TOKENMIX_CPU_CAP", nullptr);
  return cpu_features();
}

// A small attention problem with deterministic inputs.
struct Small {
  static constexpr std::int64_t B = 1, T = 37, Hq = 4, Hkv = 2, D = 24;
  std::vector<float> q, k, v, out, lse, dout, dq, dk, dv;
  Small() {
    const auto fill = [](std::vector<float>& x, std::size_t n, float phase) {
      x.resize(n);
      for (std::size_t i = 0; i < n; ++i) x[i] = std::sin(0.37f * static_cast<float>(i) + phase);
    };
    fill(q, B * T * Hq * D, 0.1f);
    fill(k, B * T * Hkv * D, 0.7f);
    fill(v, B * T * Hkv * D, 1.3f);
    fill(dout, B * T * Hq * D, 2.1f);
    out.assign(B * T * Hq * D, std::nanf(""));
    lse.assign(B * Hq * T, std::nanf(""));
    dq.assign(q.size(), std::nanf(""));
    dk.assign(k.size(), std::nanf(""));
    dv.assign(v.size(), std::nanf(""));
  }
  void forward(Isa isa) {
    AttentionOptions o;
    o.isa = isa;
    o.threads = 2;
    attention_forward(
        ConstTensorView::bthd(q.data(), B, T, Hq, D), ConstTensorView::bthd(k.data(), B, T, Hkv, D),
        ConstTensorView::bthd(v.data(), B, T, Hkv, D), TensorView::bthd(out.data(), B, T, Hq, D),
        TensorView::bht(lse.data(), B, Hq, T), o);
  }
  void backward(Isa isa) {
    AttentionOptions o;
    o.isa = isa;
    attention_backward(
        ConstTensorView::bthd(q.data(), B, T, Hq, D), ConstTensorView::bthd(k.data(), B, T, Hkv, D),
        ConstTensorView::bthd(v.data(), B, T, Hkv, D),
        ConstTensorView::bthd(out.data(), B, T, Hq, D), ConstTensorView::bht(lse.data(), B, Hq, T),
        ConstTensorView::bthd(dout.data(), B, T, Hq, D), TensorView::bthd(dq.data(), B, T, Hq, D),
        TensorView::bthd(dk.data(), B, T, Hkv, D), TensorView::bthd(dv.data(), B, T, Hkv, D), o);
  }
};

// A one-layer cache holding `len` positions, and one decode step against it.
std::vector<float> decode_once(Isa isa, DType dtype) {
  constexpr std::int64_t Hkv = 2, Hq = 6, D = 20, len = 150;
  KVCacheConfig c;
  c.layers = 1;
  c.batch = 1;
  c.heads_kv = Hkv;
  c.head_dim = D;
  c.capacity = 200;
  c.dtype = dtype;
  KVCache cache(c);
  std::vector<float> k(len * Hkv * D), v(len * Hkv * D), q(Hq * D);
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = std::sin(0.11f * static_cast<float>(i));
    v[i] = std::cos(0.07f * static_cast<float>(i));
  }
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = std::sin(0.5f * static_cast<float>(i) + 1.0f);
  cache.append(0, 0, ConstTensorView::bthd(k.data(), 1, len, Hkv, D),
               ConstTensorView::bthd(v.data(), 1, len, Hkv, D));
  std::vector<float> out(Hq * D, std::nanf(""));
  DecodeOptions o;
  o.isa = isa;
  attention_decode(ConstTensorView::bthd(q.data(), 1, 1, Hq, D), cache, 0,
                   TensorView::bthd(out.data(), 1, 1, Hq, D), {}, o);
  return out;
}

// ---- The registry --------------------------------------------------------------------------

TEST(Dispatch, RegistryHasOneEntryPerPathWithKernelsNamedAfterIt) {
  const auto sets = kernels::kernel_sets();
  ASSERT_EQ(sets.size(), 5u);
  EXPECT_EQ(sets[0].isa, Isa::portable);
  EXPECT_EQ(sets[1].isa, Isa::avx2);
  EXPECT_EQ(sets[2].isa, Isa::avx512);
  EXPECT_EQ(sets[3].isa, Isa::neon);
  EXPECT_EQ(sets[4].isa, Isa::avx512_bf16);  // appended: avx512 + the AVX512-BF16 bf16 forward
  EXPECT_TRUE(sets[0].compiled());
  // Which SIMD family a build has follows its architecture: x86 builds the AVX paths and no
  // NEON, AArch64 builds NEON and no AVX path; the AVX-512 kernels unless the build leaves them
  // out (TOKENMIX_SIMD_AVX512=OFF, the clang instrumented builds: tests/CMakeLists.txt).
#if defined(__x86_64__)
  EXPECT_FALSE(sets[3].compiled());
  EXPECT_TRUE(sets[1].compiled());
  EXPECT_EQ(sets[2].compiled(), TOKENMIX_TEST_AVX512_KERNELS != 0);
  EXPECT_EQ(sets[4].compiled(), TOKENMIX_TEST_AVX512_KERNELS != 0);
  EXPECT_FALSE(uncapped_features().neon);
#elif defined(__aarch64__)
  EXPECT_TRUE(sets[3].compiled());
  EXPECT_FALSE(sets[1].compiled() || sets[2].compiled() || sets[4].compiled());
  EXPECT_FALSE(uncapped_features().avx2_fma || uncapped_features().avx512f);
#endif
  const DType dtypes[] = {DType::f32, DType::bf16, DType::f16};
  for (const kernels::KernelSet& s : sets) {
    SCOPED_TRACE(to_string(s.isa));
    ASSERT_NE(s.runs_on, nullptr);
    EXPECT_GT(std::strlen(s.description), 0u);
    // avx512_bf16 reuses the avx512 kernels except its own bf16 forward and backward
    // (…_avx512bf16).
    const bool bf16_path = s.isa == Isa::avx512_bf16;
    const std::string suffix = bf16_path ? "_avx512" : std::string("_") + to_string(s.isa);
    for (int i = 0; i < kernels::kDTypeCount; ++i) {
      const std::string dt = to_string(dtypes[i]);
      const std::string own_suffix = bf16_path && i == 1 ? "_avx512bf16" : suffix;
      // Every column that names a kernel follows attention_<op>_<dtype>_<isa>.
      if (s.forward[i].name != nullptr) {
        EXPECT_EQ(s.forward[i].name, "attention_fwd_" + dt + own_suffix);
      }
      if (s.backward[i].name != nullptr) {
        EXPECT_EQ(s.backward[i].name, "attention_bwd_" + dt + own_suffix);
      }
      ASSERT_NE(s.decode[i].name, nullptr);
      EXPECT_EQ(s.decode[i].name, "attention_decode_" + dt + suffix);
      // A compiled path has a decode kernel for every cache dtype; an uncompiled one none.
      EXPECT_EQ(s.decode[i].fn != nullptr, s.compiled());
    }
    // The quantized cache columns (SPEC "Quantized KV cache"): a decode kernel on every path.
    const std::pair<DType, const char*> quant[] = {{DType::int8, "int8"},
                                                   {DType::fp8_e4m3, "fp8_e4m3"}};
    for (auto [dt, name] : quant) {
      const int i = kernels::cache_column(dt);
      ASSERT_GE(i, kernels::kDTypeCount);
      ASSERT_LT(i, kernels::kCacheDTypeCount);
      ASSERT_NE(s.decode[i].name, nullptr);
      EXPECT_EQ(s.decode[i].name, std::string("attention_decode_") + name + suffix);
      EXPECT_EQ(s.decode[i].fn != nullptr, s.compiled());
    }
    EXPECT_EQ(s.backward[0].fn != nullptr, s.compiled());  // f32 forward and backward together
    // Forward/backward of bf16/f16 activations (SPEC "Reduced precision") on every compiled path.
    for (int i = 1; i < kernels::kDTypeCount; ++i) {
      EXPECT_EQ(s.forward[i].fn != nullptr, s.compiled());
      EXPECT_EQ(s.backward[i].fn != nullptr, s.compiled());
    }
  }
  // available_isas() is exactly the compiled sets whose CPU features are present.
  std::vector<Isa> expect;
  for (const kernels::KernelSet& s : sets) {
    if (s.compiled() && s.runs_on(cpu_features())) expect.push_back(s.isa);
  }
  EXPECT_EQ(available_isas(), expect);
}

TEST(Dispatch, DescribeKernelNamesTheRegistryKernels) {
  for (Isa isa : available_isas()) {
    const std::string text = describe_kernel(isa);
    const kernels::KernelSet& s = kernels::kernel_set(isa);
    for (const auto& k : s.decode) EXPECT_NE(text.find(k.name), std::string::npos) << text;
    EXPECT_NE(text.find(s.forward[0].name), std::string::npos) << text;
    EXPECT_NE(text.find(s.backward[0].name), std::string::npos) << text;
    EXPECT_NE(text.find(s.description), std::string::npos) << text;
  }
}

TEST(Dispatch, SelectionFollowsTheTableAndTheExplicitKeyCountRule) {
  for (Isa isa : available_isas()) {
    SCOPED_TRACE(to_string(isa));
    const kernels::KernelSet& s = kernels::kernel_set(isa);
    EXPECT_EQ(kernels::select_forward("t", isa, DType::f32, 100).fn, s.forward[0].fn);
    EXPECT_EQ(kernels::select_backward("t", isa, DType::f32, 100).fn, s.backward[0].fn);
    EXPECT_EQ(kernels::select_decode("t", isa, DType::bf16).fn, s.decode[1].fn);
    EXPECT_STREQ(kernels::select_decode("t", isa, DType::f16).name, s.decode[2].name);
    EXPECT_EQ(kernels::select_decode("t", isa, DType::int8).fn, s.decode[3].fn);
    EXPECT_STREQ(kernels::select_decode("t", isa, DType::fp8_e4m3).name, s.decode[4].name);
    try {  // not a cache dtype: UnsupportedError naming the path and the dtype
      kernels::select_decode("t", isa, DType::i32);
      ADD_FAILURE() << "select_decode accepted i32";
    } catch (const UnsupportedError& e) {
      EXPECT_NE(std::string(e.what()).find("no decode kernel for dtype i32"), std::string::npos)
          << e.what();
    }
    // T_k beyond what a set indexes (int32 lanes for SIMD) runs the portable kernel.
    if (s.max_keys < INT64_MAX) {
      EXPECT_STREQ(kernels::select_forward("t", isa, DType::f32, s.max_keys).name,
                   s.forward[0].name);
      EXPECT_STREQ(kernels::select_forward("t", isa, DType::f32, s.max_keys + 1).name,
                   "attention_fwd_f32_portable");
      EXPECT_STREQ(kernels::select_backward("t", isa, DType::f32, s.max_keys + 1).name,
                   "attention_bwd_f32_portable");
    }
    // Every column is filled: bf16 and f16 select their own kernels.
    EXPECT_EQ(kernels::select_forward("t", isa, DType::bf16, 100).fn, s.forward[1].fn);
    EXPECT_EQ(kernels::select_backward("t", isa, DType::f16, 100).fn, s.backward[2].fn);
    // A dtype past the columns is an error naming the entry point and the dtype.
    expect_error<UnsupportedError>(
        [&] { (void)kernels::select_forward("attention_forward", isa, DType::i32, 10); },
        ErrorCode::unsupported, {"attention_forward", "i32", to_string(isa)});
  }
}

TEST(Dispatch, KVTileLayoutMatchesTheCacheConstant) {
  static_assert(KVCache::kKeyTile == kernels::KVTileLayout::kKeyTile);
  const kernels::KVTileLayout l{3, 10, 128, 5};
  EXPECT_EQ(l.tile_elems(), 640);
  EXPECT_EQ(l.head_block_elems(), 2 * 128 * 10);
  EXPECT_EQ(l.layer_elems(), 5 * 3 * 2 * 128 * 10);
  // Position 70 of block 2, head 1: second tile pair of that (block, head).
  const std::int64_t k = l.k_tile(2, 1, 70);
  EXPECT_EQ(k, (2 * 3 + 1) * 2560 + 2 * 640);
  EXPECT_EQ(l.k_tile(2, 1, 64), k);  // any position of the tile
  EXPECT_EQ(l.v_tile(2, 1, 70), k + 640);
  EXPECT_EQ(l.key_in_tile(70, 4), 4 * 64 + 6);
  EXPECT_EQ(l.value_in_tile(70, 4), 6 * 10 + 4);
  // int8 tiles in VNNI-4 quads: K [d_h / 4][64][4] then the d_h % 4 tail rows [2][64] (d_h 10),
  // V [16][d_h][4]; the same sizes, every (position, feature) of a tile at its own byte.
  kernels::KVTileLayout q = l;
  q.int8_quads = true;
  EXPECT_EQ(q.tile_elems(), 640);
  EXPECT_EQ(q.key_in_tile(70, 5), 1 * 4 * 64 + 6 * 4 + 1);    // quad 1, key 6, element 1
  EXPECT_EQ(q.key_in_tile(70, 9), 9 * 64 + 6);                // tail row 9
  EXPECT_EQ(q.value_in_tile(70, 4), 1 * 4 * 10 + 4 * 4 + 2);  // key quad 1, feature 4, key 6 % 4
  std::vector<int> k_seen(640), v_seen(640);
  for (std::int64_t u = 0; u < 64; ++u)
    for (std::int64_t x = 0; x < 10; ++x) {
      ++k_seen.at(static_cast<std::size_t>(q.key_in_tile(u, x)));
      ++v_seen.at(static_cast<std::size_t>(q.value_in_tile(u, x)));
    }
  EXPECT_EQ(std::count(k_seen.begin(), k_seen.end(), 1), 640);
  EXPECT_EQ(std::count(v_seen.begin(), v_seen.end(), 1), 640);
}

// ---- Entry-point names in ISA errors ---------------------------------------------------------

TEST(Dispatch, ForcedIsaErrorsNameTheEntryPoint) {
  // With the cap at portable, avx2 and avx512 are unavailable on every CPU.
  const ScopedEnv cap("TOKENMIX_CPU_CAP", "portable");
  const ScopedEnv isa_env("TOKENMIX_ISA", nullptr);
  for (Isa isa : {Isa::avx2, Isa::avx512}) {
    SCOPED_TRACE(to_string(isa));
    Small s;
    expect_error<UnsupportedError>([&] { s.forward(isa); }, ErrorCode::unsupported,
                                   {"attention_forward", to_string(isa), "available: portable"});
    expect_error<UnsupportedError>([&] { s.backward(isa); }, ErrorCode::unsupported,
                                   {"attention_backward", to_string(isa)});
    expect_error<UnsupportedError>([&] { (void)decode_once(isa, DType::bf16); },
                                   ErrorCode::unsupported, {"attention_decode", to_string(isa)});
    expect_error<UnsupportedError>([&] { (void)resolve_isa(isa); }, ErrorCode::unsupported,
                                   {"resolve_isa", to_string(isa)});
    // Nothing was written.
    EXPECT_TRUE(std::all_of(s.out.begin(), s.out.end(), [](float x) { return std::isnan(x); }));
    EXPECT_TRUE(std::all_of(s.dq.begin(), s.dq.end(), [](float x) { return std::isnan(x); }));
  }
  // A bad TOKENMIX_ISA names the entry point too.
  const ScopedEnv bad_isa("TOKENMIX_ISA", "sse9");
  Small s;
  expect_error<ArgumentError>([&] { s.forward(Isa::automatic); }, ErrorCode::invalid_argument,
                              {"attention_forward", "TOKENMIX_ISA", "sse9"});
}

TEST(Dispatch, ForcingAPathThisBuildLacksNamesTheBuild) {
  // x86 builds have no neon kernels, AArch64 builds no avx2/avx512 ones: forcing one (option or
  // TOKENMIX_ISA) is an UnsupportedError saying so, whatever the CPU and the cap.
  const ScopedEnv cap("TOKENMIX_CPU_CAP", nullptr);
  int lacking = 0;
  for (const kernels::KernelSet& set : kernels::kernel_sets()) {
    if (set.compiled()) continue;
    ++lacking;
    const Isa isa = set.isa;
    SCOPED_TRACE(to_string(isa));
    EXPECT_FALSE(contains(available_isas(), isa));
    const std::initializer_list<std::string> parts = {"attention_forward", to_string(isa),
                                                      "this build has no kernels for it"};
    Small s;
    expect_error<UnsupportedError>([&] { s.forward(isa); }, ErrorCode::unsupported, parts);
    {
      const ScopedEnv isa_env("TOKENMIX_ISA", to_string(isa));
      expect_error<UnsupportedError>([&] { s.forward(Isa::automatic); }, ErrorCode::unsupported,
                                     parts);
      expect_error<UnsupportedError>([&] { (void)decode_once(Isa::automatic, DType::f16); },
                                     ErrorCode::unsupported,
                                     {"attention_decode", to_string(isa), "this build"});
    }
    EXPECT_TRUE(std::all_of(s.out.begin(), s.out.end(), [](float x) { return std::isnan(x); }));
    EXPECT_NE(describe_kernel(isa).find("not compiled"), std::string::npos);
  }
#if defined(__x86_64__) || defined(__aarch64__)
  EXPECT_GE(lacking, 1);  // neon on x86; avx2 and avx512 on AArch64
#endif
}

// ---- TOKENMIX_CPU_CAP --------------------------------------------------------------------------

TEST(Dispatch, CpuCapAvx2BehavesLikeACpuWithoutAvx512) {
  const CpuFeatures real = uncapped_features();
  const ScopedEnv cap("TOKENMIX_CPU_CAP", "avx2");
  const ScopedEnv isa_env("TOKENMIX_ISA", nullptr);
  EXPECT_EQ(cpu_cap(), Isa::avx2);
  const CpuFeatures& f = cpu_features();
  EXPECT_EQ(f.model, real.model);
  EXPECT_EQ(f.avx2_fma, real.avx2_fma);
  EXPECT_FALSE(f.avx512f);
  EXPECT_FALSE(f.avx512_bf16);
  EXPECT_FALSE(f.amx_tile);
  EXPECT_EQ(f.neon, real.neon);  // neon ranks with avx2 (runtime.hpp): the cap leaves it
  const auto avail = available_isas();
  EXPECT_FALSE(contains(avail, Isa::avx512));
  EXPECT_EQ(contains(avail, Isa::neon), real.neon && kernels::kernel_set(Isa::neon).compiled());
  EXPECT_EQ(contains(avail, Isa::avx2), real.avx2_fma && kernels::kernel_set(Isa::avx2).compiled());
  const Isa best = avail.back();
  EXPECT_EQ(resolve_isa(Isa::automatic), best);
  EXPECT_NE(describe_kernel(Isa::automatic).find(std::string("_") + to_string(best)),
            std::string::npos);
  // Forcing avx512 fails as on a CPU without it (on a build without avx512 kernels, because of
  // the build: ForcingAPathThisBuildLacksNamesTheBuild).
  Small s;
  expect_error<UnsupportedError>(
      [&] { s.forward(Isa::avx512); }, ErrorCode::unsupported,
      {"attention_forward", "avx512",
       kernels::kernel_set(Isa::avx512).compiled() ? "does not support" : "this build has no"});
  // Auto runs the capped path: bitwise the same as forcing it.
  s.forward(Isa::automatic);
  Small forced;
  forced.forward(best);
  EXPECT_EQ(0, std::memcmp(s.out.data(), forced.out.data(), s.out.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(s.lse.data(), forced.lse.data(), s.lse.size() * sizeof(float)));
  s.backward(Isa::automatic);
  forced.backward(best);
  EXPECT_EQ(0, std::memcmp(s.dk.data(), forced.dk.data(), s.dk.size() * sizeof(float)));
  const auto d_auto = decode_once(Isa::automatic, DType::f16);
  const auto d_forced = decode_once(best, DType::f16);
  EXPECT_EQ(0, std::memcmp(d_auto.data(), d_forced.data(), d_auto.size() * sizeof(float)));
}

TEST(Dispatch, CpuCapPortableBehavesLikeANonX86Cpu) {
  const CpuFeatures real = uncapped_features();
  const ScopedEnv cap("TOKENMIX_CPU_CAP", "portable");
  const ScopedEnv isa_env("TOKENMIX_ISA", nullptr);
  EXPECT_EQ(cpu_cap(), Isa::portable);
  const CpuFeatures& f = cpu_features();
  EXPECT_EQ(f.model, real.model);
  EXPECT_FALSE(f.avx2_fma || f.avx512f || f.avx512_bf16 || f.amx_tile || f.neon);
  EXPECT_TRUE(f.flags().empty());
  EXPECT_EQ(available_isas(), std::vector<Isa>{Isa::portable});
  EXPECT_EQ(resolve_isa(Isa::automatic), Isa::portable);
  Small s, forced;
  s.forward(Isa::automatic);
  forced.forward(Isa::portable);
  EXPECT_EQ(0, std::memcmp(s.out.data(), forced.out.data(), s.out.size() * sizeof(float)));
}

TEST(Dispatch, CpuCapAvx512AndEmptyHideNothingBelowAvx512) {
  const CpuFeatures real = uncapped_features();
  std::vector<Isa> uncapped;
  {
    const ScopedEnv cap("TOKENMIX_CPU_CAP", nullptr);
    EXPECT_EQ(cpu_cap(), Isa::automatic);
    uncapped = available_isas();
  }
  {
    const ScopedEnv cap("TOKENMIX_CPU_CAP", "");  // empty = no cap
    EXPECT_EQ(cpu_cap(), Isa::automatic);
    EXPECT_EQ(available_isas(), uncapped);
    EXPECT_EQ(cpu_features().amx_tile, real.amx_tile);
  }
  {
    const ScopedEnv cap("TOKENMIX_CPU_CAP", "avx512");
    EXPECT_EQ(cpu_cap(), Isa::avx512);
    EXPECT_EQ(available_isas(), uncapped);
    EXPECT_EQ(cpu_features().avx512f, real.avx512f);
    EXPECT_FALSE(cpu_features().amx_tile);
  }
}

TEST(Dispatch, InvalidCpuCapIsAnArgumentErrorNamingTheVariable) {
  const ScopedEnv cap("TOKENMIX_CPU_CAP", "avx3");
  const std::initializer_list<std::string> parts = {"TOKENMIX_CPU_CAP", "avx3", "portable", "avx2",
                                                    "avx512"};
  expect_error<ArgumentError>([] { (void)cpu_features(); }, ErrorCode::invalid_argument, parts);
  expect_error<ArgumentError>([] { (void)cpu_cap(); }, ErrorCode::invalid_argument, parts);
  expect_error<ArgumentError>([] { (void)available_isas(); }, ErrorCode::invalid_argument,
                              {"available_isas", "TOKENMIX_CPU_CAP"});
  expect_error<ArgumentError>([] { (void)resolve_isa(Isa::portable); }, ErrorCode::invalid_argument,
                              {"resolve_isa", "TOKENMIX_CPU_CAP"});
  Small s;
  expect_error<ArgumentError>([&] { s.forward(Isa::portable); }, ErrorCode::invalid_argument,
                              {"attention_forward", "TOKENMIX_CPU_CAP", "avx3"});
  expect_error<ArgumentError>([&] { (void)decode_once(Isa::automatic, DType::f32); },
                              ErrorCode::invalid_argument,
                              {"attention_decode", "TOKENMIX_CPU_CAP"});
}

// TOKENMIX_FP8_WIDEN (detail::fp8_direct_widening) is read by decode over an fp8 E4M3 cache:
// direct / f16 / unset / empty are accepted, anything else is an ArgumentError naming the entry
// point, the variable, what it may be and what it was. Other cache dtypes do not read it.
TEST(Dispatch, InvalidFp8WideningIsAnArgumentErrorNamingTheVariable) {
  for (const char* ok : {"direct", "f16", "", static_cast<const char*>(nullptr)}) {
    const ScopedEnv env("TOKENMIX_FP8_WIDEN", ok);
    EXPECT_NO_THROW((void)decode_once(Isa::automatic, DType::fp8_e4m3)) << (ok ? ok : "unset");
  }
  const ScopedEnv env("TOKENMIX_FP8_WIDEN", "bf16");
  expect_error<ArgumentError>([] { (void)decode_once(Isa::automatic, DType::fp8_e4m3); },
                              ErrorCode::invalid_argument,
                              {"attention_decode", "TOKENMIX_FP8_WIDEN", "direct, f16", "'bf16'"});
  EXPECT_NO_THROW((void)decode_once(Isa::automatic, DType::int8));
}

// A per-CPU rule (vendor AuthenticAMD or not, CPUID display family) that holds on AMD family 19h
// and 1Ah only: true there, false on the neighbouring AMD families and on every other vendor.
void ExpectTrueOnAmdFamilies19hAnd1AhOnly(bool (*rule)(bool amd, unsigned family)) {
  struct Cpu {
    bool amd;
    unsigned family;
    bool expected;
  };
  for (const Cpu& c : {Cpu{true, 0x19u, true}, Cpu{true, 0x1Au, true}, Cpu{true, 0x17u, false},
                       Cpu{true, 0x1Bu, false}, Cpu{true, 0x0Fu, false}, Cpu{false, 0x06u, false},
                       Cpu{false, 0x19u, false}, Cpu{false, 0x1Au, false}}) {
    EXPECT_EQ(rule(c.amd, c.family), c.expected)
        << (c.amd ? "AMD" : "other vendor") << " family 0x" << std::hex << c.family;
  }
}

// The automatic fp8 widening (TOKENMIX_FP8_WIDEN unset) as a function of the CPU alone, so the
// table holds on every machine: direct on AMD family 19h (Zen 3, Zen 4) and 1Ah (Zen 5), where
// it was measured faster (docs/performance.md, D-fp8-6); f16 bits on every other family and vendor.
TEST(Dispatch, Fp8DirectWideningIsPreferredOnAmdFamilies19hAnd1AhOnly) {
  ExpectTrueOnAmdFamilies19hAnd1AhOnly(&detail::fp8_direct_preferred);
}

// The automatic choice of the avx512_bf16 path (vdpbf16ps bf16 forward) as a function of the CPU
// alone, so the table holds on every machine: AMD family 19h (Zen 4) and 1Ah (Zen 5), where it
// measured 1.3× faster than the widening forward; never on Intel, where it measured 1.7× slower
// (docs/performance.md, D-bf16-2, D-bf16-7), nor on other AMD families.
TEST(Dispatch, Bf16ProductsArePreferredOnAmdFamilies19hAnd1AhOnly) {
  ExpectTrueOnAmdFamilies19hAnd1AhOnly(&detail::bf16_products_preferred);
  // The registry carries the rule: avx512_bf16 is the one path that is opt-in by default and
  // automatic where preferred_on holds; every other path is automatic everywhere.
  for (const kernels::KernelSet& set : kernels::kernel_sets()) {
    const bool bf16_path = set.isa == Isa::avx512_bf16;
    EXPECT_EQ(set.automatic, !bf16_path) << to_string(set.isa);
    EXPECT_EQ(set.preferred_on, bf16_path ? &detail::bf16_products_preferred : nullptr)
        << to_string(set.isa);
    EXPECT_TRUE(detail::automatic_may_pick(set) || bf16_path) << to_string(set.isa);
  }
}

// Isa::automatic on this CPU: avx512_bf16 exactly where it runs and the rule prefers it, so a bf16
// forward then runs the vdpbf16ps kernel; TOKENMIX_ISA=avx512 still forces the widening one, and
// TOKENMIX_CPU_CAP=avx2 hides the path (the expectations read the CPU through the rule, so they
// hold on every machine).
TEST(Dispatch, AutomaticPicksAvx512Bf16ExactlyWhereTheRulePrefersIt) {
  const ScopedEnv no_cap("TOKENMIX_CPU_CAP", nullptr);
  const ScopedEnv isa_env("TOKENMIX_ISA", nullptr);
  const auto avail = available_isas();
  const kernels::KernelSet& bf16_set = kernels::kernel_set(Isa::avx512_bf16);
  const bool picked = contains(avail, Isa::avx512_bf16) && detail::automatic_may_pick(bf16_set);
  const Isa chosen = resolve_isa(Isa::automatic);
  EXPECT_EQ(chosen == Isa::avx512_bf16, picked);
  const std::string fwd = kernels::select_forward("t", chosen, DType::bf16, 100).name;
  EXPECT_EQ(fwd == "attention_fwd_bf16_avx512bf16", picked) << fwd;
  const std::string bwd = kernels::select_backward("t", chosen, DType::bf16, 100).name;
  EXPECT_EQ(bwd == "attention_bwd_bf16_avx512bf16", picked) << bwd;
  // Its f32 and f16 kernels are avx512's: only the bf16 forward and backward change.
  if (picked) {
    EXPECT_EQ(kernels::select_forward("t", chosen, DType::f32, 100).fn,
              kernels::select_forward("t", Isa::avx512, DType::f32, 100).fn);
    EXPECT_EQ(kernels::select_backward("t", chosen, DType::f16, 100).fn,
              kernels::select_backward("t", Isa::avx512, DType::f16, 100).fn);
  }
  if (contains(avail, Isa::avx512)) {
    const ScopedEnv forced("TOKENMIX_ISA", "avx512");
    EXPECT_EQ(resolve_isa(Isa::automatic), Isa::avx512);
  }
  {
    const ScopedEnv cap("TOKENMIX_CPU_CAP", "avx2");
    EXPECT_NE(resolve_isa(Isa::automatic), Isa::avx512_bf16);
  }
}

// TOKENMIX_LINEAR_PREFETCH (detail::linear_decode_prefetch) is read by every decode call (any
// cache dtype): all / per-dtype / unset / empty are accepted and linear_decode_prefetch() follows
// them; anything else is an ArgumentError naming the entry point, the variable, what it may be
// and what it was.
TEST(Dispatch, InvalidLinearPrefetchIsAnArgumentErrorNamingTheVariable) {
  for (const char* ok : {"all", "per-dtype", "", static_cast<const char*>(nullptr)}) {
    const ScopedEnv env("TOKENMIX_LINEAR_PREFETCH", ok);
    EXPECT_NO_THROW((void)decode_once(Isa::automatic, DType::bf16)) << (ok ? ok : "unset");
  }
  {
    const ScopedEnv env("TOKENMIX_LINEAR_PREFETCH", "all");
    EXPECT_TRUE(linear_decode_prefetch());
  }
  {
    const ScopedEnv env("TOKENMIX_LINEAR_PREFETCH", "per-dtype");
    EXPECT_FALSE(linear_decode_prefetch());
  }
  const ScopedEnv env("TOKENMIX_LINEAR_PREFETCH", "rows");
  for (const DType dt : {DType::f32, DType::int8}) {
    expect_error<ArgumentError>(
        [dt] { (void)decode_once(Isa::automatic, dt); }, ErrorCode::invalid_argument,
        {"attention_decode", "TOKENMIX_LINEAR_PREFETCH", "all, per-dtype", "'rows'"});
  }
  expect_error<ArgumentError>([] { (void)linear_decode_prefetch(); }, ErrorCode::invalid_argument,
                              {"linear_decode_prefetch", "TOKENMIX_LINEAR_PREFETCH"});
}

// The automatic prefetch order (TOKENMIX_LINEAR_PREFETCH unset) as a function of the CPU's vendor
// alone, so the table holds on every machine: every cache dtype in address order on Intel, where
// it was measured faster (docs/performance.md, D-prefetch-6); each path's per-dtype choice
// elsewhere.
TEST(Dispatch, LinearPrefetchForEveryCacheDtypeIsPreferredOnIntelOnly) {
  EXPECT_TRUE(detail::linear_prefetch_preferred(true));
  EXPECT_FALSE(detail::linear_prefetch_preferred(false));
}

// Decode's tuning is a field of each registry entry (KernelSet::decode_tunables): portable and
// neon have none of the choices, avx2 the fp8 widening and the prefetch order, the avx512 paths
// also AMX where the build has it. decode_tuning(path) and each decode call pick only among the
// entry's choices, whatever the switches ask; the expectations read the CPU through the public
// switch functions, so they hold on every CPU.
TEST(Dispatch, DecodeTuningIsTheResolvedPathsRegistryEntry) {
  const ScopedEnv cap("TOKENMIX_CPU_CAP", nullptr);
  const ScopedEnv isa_env("TOKENMIX_ISA", nullptr);
  const ScopedEnv amx("TOKENMIX_DECODE_AMX", nullptr);
  for (const kernels::KernelSet& set : kernels::kernel_sets()) {
    const bool simd_x86 =
        set.isa == Isa::avx2 || set.isa == Isa::avx512 || set.isa == Isa::avx512_bf16;
    EXPECT_EQ(set.decode_tunables.fp8_direct, simd_x86) << to_string(set.isa);
    EXPECT_EQ(set.decode_tunables.linear_prefetch, simd_x86) << to_string(set.isa);
    if (set.isa != Isa::avx512 && set.isa != Isa::avx512_bf16) {
      EXPECT_FALSE(set.decode_tunables.amx) << to_string(set.isa);
    }
    EXPECT_NE(std::string(set.decode_tunables.prefetch_by_dtype), "") << to_string(set.isa);
  }
  for (const Isa isa : available_isas()) {
    const kernels::DecodeTunables& has = kernels::kernel_set(isa).decode_tunables;
    for (const char* widen : {"direct", "f16"}) {
      for (const char* order : {"all", "per-dtype"}) {
        const ScopedEnv w("TOKENMIX_FP8_WIDEN", widen);
        const ScopedEnv o("TOKENMIX_LINEAR_PREFETCH", order);
        const DecodeTuning t = decode_tuning(isa);
        EXPECT_EQ(t.isa, isa);
        EXPECT_EQ(t.fp8_direct, has.fp8_direct && std::string(widen) == "direct")
            << to_string(isa) << " " << widen;
        EXPECT_EQ(t.linear_prefetch, has.linear_prefetch && std::string(order) == "all")
            << to_string(isa) << " " << order;
        EXPECT_EQ(t.prefetch_by_dtype, has.prefetch_by_dtype);
      }
    }
    const DecodeTuning automatic = decode_tuning(isa);
    EXPECT_EQ(automatic.fp8_direct, has.fp8_direct && fp8_direct_widening()) << to_string(isa);
    EXPECT_EQ(automatic.linear_prefetch, has.linear_prefetch && linear_decode_prefetch())
        << to_string(isa);
    if (!has.amx) {
      EXPECT_FALSE(automatic.amx_int8 || automatic.amx_fp8 || automatic.amx_bf16) << to_string(isa);
      const ScopedEnv on("TOKENMIX_DECODE_AMX", "on");
      expect_error<UnsupportedError>(
          [isa] { (void)decode_tuning(isa); }, ErrorCode::unsupported,
          {"decode_tuning", "TOKENMIX_DECODE_AMX=on", to_string(isa), "no AMX tile products"});
    }
  }
  EXPECT_EQ(decode_tuning().isa, resolve_isa(Isa::automatic));
}

// ---- ResourceError ---------------------------------------------------------------------------

TEST(Dispatch, AllocationFailureIsAResourceErrorNamingTheSize) {
  const kernels::CallSite site{"attention_forward", "attention_fwd_f32_avx2"};
  const std::int64_t huge = std::int64_t{1} << 60;  // 1 EiB: no system grants it
  expect_error<ResourceError>([&] { (void)kernels::allocate_bytes(huge, site, "a test buffer"); },
                              ErrorCode::out_of_memory,
                              {"attention_forward", "attention_fwd_f32_avx2", "a test buffer",
                               std::to_string(huge) + " bytes"});
  EXPECT_STREQ(to_string(ErrorCode::out_of_memory), "out_of_memory");
  // Sizes that overflow int64 are a ResourceError(overflow), not a wrapped-around allocation.
  kernels::ScratchLayout layout(site);
  (void)layout.add<float>(std::int64_t{1} << 60);  // 2^62 bytes: representable
  expect_error<ResourceError>([&] { (void)layout.add<float>(std::int64_t{1} << 60); },
                              ErrorCode::overflow, {"attention_forward", "overflows"});
  expect_error<ResourceError>([&] { kernels::ScratchArena a(layout, 1 << 20, "scratch"); },
                              ErrorCode::overflow, {"attention_forward", "scratch", "overflows"});
  // A small arena: every slot 64-byte aligned, workers apart by the layout's size.
  kernels::ScratchLayout small(site);
  const auto a = small.add<float>(3);
  const auto b = small.add<std::int32_t>(5);
  EXPECT_EQ(small.bytes() % kernels::kScratchAlign, 0);
  const kernels::ScratchArena arena(small, 3, "scratch");
  for (int w = 0; w < 3; ++w) {
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(arena.at(a, w)) % kernels::kScratchAlign, 0u);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(arena.at(b, w)) % kernels::kScratchAlign, 0u);
    arena.at(a, w)[2] = 1.0f;  // writable to the end
    arena.at(b, w)[4] = 1;
  }
}

// A head width whose kernel scratch cannot exist (issue: d_h = 2^26 crashed the AVX2 kernels).
// q, k, v and dO are d_h-long views with stride 0 (valid, one float each). Outputs may not have a
// zero stride (they would overlap themselves), so out, dq, dk and dv are unit-stride views
// in a reserved, inaccessible address range (PROT_NONE: no memory behind it): validation only
// does arithmetic on their extents, and the kernel's scratch allocation (tens of TiB at
// d_h = 2^40, on any path) fails before anything is written — a write would fault here.
class NoAccessRange {
 public:
  explicit NoAccessRange(std::size_t bytes) : bytes_(bytes) {
    void* p = mmap(nullptr, bytes_, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    base_ = p == MAP_FAILED ? nullptr : p;
  }
  ~NoAccessRange() {
    if (base_ != nullptr) munmap(base_, bytes_);
  }
  NoAccessRange(const NoAccessRange&) = delete;
  NoAccessRange& operator=(const NoAccessRange&) = delete;
  float* data() const { return static_cast<float*>(base_); }

 private:
  std::size_t bytes_;
  void* base_ = nullptr;
};

void huge_head_width(Isa isa, std::int64_t dh, ErrorCode code) {
  float q = 0.5f, k = 0.25f, v = 1.0f, lse = std::nanf(""), dout = 1.0f;
  // Three disjoint outputs of d_h floats each (out / dq, dk, dv).
  const NoAccessRange no_access(3 * static_cast<std::size_t>(dh) * sizeof(float));
  ASSERT_NE(no_access.data(), nullptr) << "mmap(PROT_NONE) of 3 * d_h floats failed";
  float* const unwritable = no_access.data();
  const auto in = [&](const float* p) {
    return ConstTensorView{p, DType::f32, 4, {1, 1, 1, dh}, {0, 0, 0, 0}};
  };
  const auto outv = [&](float* p) {
    return TensorView{p, DType::f32, 4, {1, 1, 1, dh}, {dh, dh, dh, 1}};
  };
  AttentionOptions o;
  o.isa = isa;
  const std::string bytes = code == ErrorCode::out_of_memory ? "bytes" : "overflows";
  expect_error<ResourceError>(
      [&] {
        attention_forward(in(&q), in(&k), in(&v), outv(unwritable), TensorView::bht(&lse, 1, 1, 1),
                          o);
      },
      code, {"attention_forward", kernels::kernel_set(isa).forward[0].name, bytes});
  expect_error<ResourceError>(
      [&] {
        attention_backward(in(&q), in(&k), in(&v), in(&q), ConstTensorView::bht(&lse, 1, 1, 1),
                           in(&dout), outv(unwritable), outv(unwritable + dh),
                           outv(unwritable + 2 * dh), o);
      },
      code, {"attention_backward", kernels::kernel_set(isa).backward[0].name, bytes});
  EXPECT_TRUE(std::isnan(lse));
}

TEST(Dispatch, HugeHeadWidthIsAResourceErrorOnEveryPath) {
  for (Isa isa : available_isas()) {
    SCOPED_TRACE(to_string(isa));
    huge_head_width(isa, std::int64_t{1} << 40, ErrorCode::out_of_memory);  // TiB of scratch
  }
}

}  // namespace
}  // namespace tokenmix::testing
