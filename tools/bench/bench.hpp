// tools/bench/bench.hpp — `tokenmix bench`: our kernels next to the machine's ceilings.
//
// Every figure is a ratio to a ceiling measured in the same run on the same machine:
//   forward/backward: useful GFLOP/s (SPEC "Useful-work counts") / OpenBLAS sgemm 2048³ GFLOP/s
//           for f32 and f16 activations (f16 runs fp32 products on widened operands), / a bf16
//           GEMM 2048³ (oneDNN matmul, bf16 × bf16 → f32) for bf16 where the CPU has bf16 GEMM
//           instructions (sgemm elsewhere); the JSON says which (ceiling_kind) and the dtype
//   decode: K/V bytes read per second (SPEC "decode bytes") / streaming read bandwidth (a
//           multi-threaded sum over a 1 GiB buffer, ≫ L3), one attention_decode step on a
//           KVCache; the same run also measures forward's sgemm ceiling and reports the roofline
//           time max(bytes / read ceiling, useful FLOPs / sgemm ceiling) and its ratio to the step
// Times are medians of several repetitions after a warm-up; each case also reports the max
// relative error against the float64 reference on a slice of rows, and the peak extra memory.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "ceilings.hpp"  // the ceilings (SgemmCeiling, StreamRead, ...): tokenmix_ceilings
#include "testkit.hpp"
#include "tokenmix/attention.hpp"
#include "tokenmix/tensor.hpp"

namespace tokenmix::bench {

/// Score variants of a bench case or a `tokenmix run` (SPEC "Score variants used by real
/// models"); all off by default. The CLI's --window, --softcap, --alibi and --sinks.
struct BenchVariants {
  std::optional<std::int64_t> window;  ///< sliding window W ≥ 1
  std::optional<double> softcap;       ///< c > 0
  bool alibi = false;                  ///< the standard slopes m_h = 2^(−8(h+1)/H_q)
  std::vector<double> sinks;           ///< empty = off; one value (every head) or H_q values
  /// Attention dropout p in [0, 1) (forward and backward only; docs/design.md D.1), offset 0.
  double dropout = 0.0;
  std::uint64_t dropout_seed = 0;

  bool any() const { return window || softcap || alibi || !sinks.empty() || dropout > 0.0; }
  /// The standard ALiBi slopes for H_q heads (empty when alibi is off).
  std::vector<float> alibi_slopes(std::int64_t H_q) const;
  /// σ_h for H_q heads (empty when off); ArgumentError naming --sinks unless it has 1 or H_q
  /// values.
  std::vector<float> sink_values(std::int64_t H_q) const;
  /// "window=4096 softcap=30 alibi sinks=0.5", "" when none.
  std::string describe() const;
  /// The JSON fields ", \"window\": 4096, \"softcap\": null, \"alibi\": false, \"sinks\": null".
  std::string json() const;
  /// Fills the variant fields of `o` with views of `alibi` and `sinks` (the caller's storage,
  /// from alibi_slopes / sink_values).
  void apply(AttentionOptions& o, const std::vector<float>& alibi,
             const std::vector<float>& sinks) const;
};

/// pairs(t) summed over the T_q rows with the causal mask (4.3) and a sliding window W (none
/// when window is empty): the useful pairs of SPEC "Useful-work counts" (the library's
/// visible_pairs / visible_pairs_windowed).
std::int64_t windowed_pairs(std::int64_t T_q, std::int64_t T_k, bool causal, CausalAlign align,
                            std::optional<std::int64_t> window);
/// Forward FLOPs 4·d_h·H_q·P·B with P = windowed_pairs (tokenmix::forward_flops or
/// forward_flops_windowed).
double windowed_forward_flops(const testkit::AttentionShape& s, std::optional<std::int64_t> window);

/// `--lengths mixed`: the per-sequence cache lengths L_b are drawn from a std::mt19937_64 seeded
/// with this (r_b its b-th output, b = 0 … B − 1; the same B and T_k always give the same
/// lengths, on any platform).
inline constexpr std::uint64_t kMixedLengthsSeed = 16;

/// Cached positions of each of the B sequences of a decode case with nominal length T_k ≥ 1:
/// all T_k (`mixed` false), or L_b = T_k − h + (r_b mod (2h + 1)) with h = ⌊T_k / 2⌋, uniform in
/// [T_k − h, T_k + h] (about [T_k/2, 3·T_k/2], mean T_k, every L_b ≥ 1), r_b as above.
std::vector<std::int64_t> decode_lengths(std::int64_t B, std::int64_t T_k, bool mixed);

struct BenchConfig {
  std::string op = "forward";             ///< "forward", "backward" or "decode"
  std::vector<std::int64_t> batch = {1};  ///< batch sizes B, one case each
  std::int64_t hq = 32, hkv = 8, dh = 128;
  std::vector<std::int64_t> tq = {512, 2048, 8192};  ///< one case per entry
  std::int64_t tk = 0;                               ///< 0 = same as each tq
  std::vector<int> threads = {0};                    ///< 0 = all; one case per entry
  bool causal = true;
  CausalAlign align = CausalAlign::bottom_right;
  std::vector<Isa> isas = {Isa::automatic};
  DType dtype = DType::f32;  ///< forward/backward: q, k, v, out (and gradients) element type
  int repeats = 5;           ///< timed runs per case (median reported)
  /// decode: visits of the whole case list, round-robin: each case is timed `repeats` times per
  /// round and its figures are the medians of all rounds' samples (so a slow phase of a shared
  /// machine lasting minutes takes part of every case's samples, not all of a few cases').
  int rounds = 1;
  bool json = false;     ///< one JSON object per line per case
  bool progress = true;  ///< progress lines on stderr
  // decode only: one case per (batch, tnew, cache_tokens, cache_dtype, threads, isa); tq is not
  // used.
  std::vector<std::int64_t> cache_tokens = {4096, 32768,
                                            131072};  ///< T_k: cached positions per sequence
  std::vector<DType> cache_dtypes = {DType::f32, DType::bf16, DType::f16};
  std::vector<std::int64_t> tnew = {1};  ///< new queries per sequence (T_new; > 1: speculative)
  /// "equal": every sequence holds cache_tokens positions; "mixed": decode_lengths(…, true)
  std::string lengths = "equal";
  /// decode: K and V channel 0 of every head multiplied by this (an outlier channel, SPEC
  /// "Quantized KV cache"); 1 = N(0, 1) everywhere. Finite and > 0.
  double kv_outlier = 1.0;
  /// decode: "normal" (N(0, 1) K and V) or "real" (K through testkit::apply_real_keys: outlier
  /// channels, per-channel offsets, massive tokens; before --kv-outlier).
  std::string kv_profile = "normal";
  BenchVariants variants;  ///< score variants of every case (forward, backward and decode)
  /// The ceilings' sizes (--gemm-n, --read-mib): the sgemm's n and the streaming read's buffer.
  /// The defaults measure the CPU (2048³; 1 GiB ≫ L3); smaller ones make quick runs and the CLI
  /// tests fast, and the JSON's ceiling_kind / ceiling_gbps_kind name the sizes used.
  int gemm_n = 2048;
  std::int64_t read_mib = 1024;
};

struct BenchResult {
  std::string op;
  std::int64_t batch, tq, tk, hq, hkv, dh;
  int threads;
  std::string isa;
  bool causal;
  std::string align;
  std::string dtype = "f32";                         ///< activations (decode: the queries)
  std::string ceiling_kind = "openblas_sgemm_2048";  ///< what ceiling_gflops measured
  std::string sgemm_core;  ///< OpenBLAS's kernel family for sgemm (sgemm_core()), every op
  double seconds;          ///< median wall time of one call
  double gflops;           ///< useful GFLOP/s
  /// forward/backward: the sgemm ceiling's median over passes interleaved with the timed calls
  /// (one per call), or oneDNN's bf16 GEMM measured once; decode: see below
  double ceiling_gflops;
  double ceiling_min = 0.0, ceiling_max = 0.0;  ///< forward/backward: the passes' spread
  double ratio;                                 ///< gflops / ceiling_gflops
  double max_rel_err;        ///< vs float64 reference on a slice: max|x − r| / max|r|
  std::int64_t extra_bytes;  ///< peak resident memory growth during the call
  // decode only (to_json writes them for op "decode"; there gflops counts the useful FLOPs
  // 4·d_h·H_q·Σ_b pairs_b (the (query, key) pairs each sequence's T_new queries see, bottom-right
  // causal, window-aware: SPEC "Useful-work counts"), ceiling_gflops is forward's sgemm ceiling
  // (ceiling_kind) measured in passes interleaved with the steps, the median of the passes (each
  // the best of two calls), and ratio = gbps / ceiling_gbps):
  std::string cache_dtype;  ///< element type of the KV cache
  double gbps = 0.0;        ///< K/V bytes read per second (SPEC "decode bytes") / 1e9
  double ceiling_gbps =
      0.0;  ///< streaming read bandwidth (StreamRead), median of passes interleaved with the steps
  double tokens_per_s = 0.0;  ///< decode: B · T_new / seconds, tokens generated per second
  /// decode: max_rel_err against the float64 oracle over the *unrounded* fp32 K/V (the cache
  /// dtype's rounding or quantization error, SPEC "Quantized KV cache": reported, not hidden)
  double err_vs_unquantized = 0.0;
  double kv_outlier = 1.0;            ///< decode: BenchConfig::kv_outlier of the case
  std::string kv_profile = "normal";  ///< decode: BenchConfig::kv_profile of the case
  std::string ceiling_gbps_kind = "stream_read_1GiB";  ///< decode: what ceiling_gbps measured
  double ratio_gflops = 0.0;                           ///< decode: gflops / ceiling_gflops
  std::uint64_t kv_bytes = 0;  ///< decode: K/V bytes the step reads (tokenmix::decode_bytes)
  double flops = 0.0;          ///< decode: useful FLOPs of the step (see gflops)
  /// decode: the roofline time of the step, 1e3 · max(kv_bytes / (ceiling_gbps · 1e9),
  /// flops / (ceiling_gflops · 1e9)): the least time the binding ceiling allows
  double roofline_ms = 0.0;
  double ratio_roofline = 0.0;  ///< decode: roofline_ms / (1e3 · seconds); 1 = at the roofline
  /// decode: the fastest and the slowest of the timed calls (seconds is their median): how much a
  /// shared machine moved the figure within this case
  double seconds_min = 0.0, seconds_max = 0.0;
  std::string lengths = "equal";  ///< decode: BenchConfig::lengths of the case
  int rounds = 1;                 ///< decode: BenchConfig::rounds (samples: rounds · repeats)
  /// decode: Σ_b L_b, min_b L_b and max_b L_b of the cached positions (tk is the nominal T_k)
  std::int64_t cache_tokens_total = 0, cache_tokens_min = 0, cache_tokens_max = 0;
  BenchVariants variants;  ///< the case's score variants (to_json writes them)
};

/// One forward or backward case of the bench: seeded contiguous [B, T, H, d_h] inputs and
/// outputs of `shape`, the call that is timed, its useful FLOPs (SPEC "Useful-work counts", from
/// the case's shape) and its error against the float64 oracle on a slice of rows.
/// `tokenmix bench forward|backward` and benchmarks/ (Google Benchmark) both time this one.
class AttentionRun {
 public:
  /// `variants`: the score variants of every call. `dtype`: f32, or bf16 / f16 (the inputs
  /// are drawn in fp32 and rounded to it; the error slice compares with the oracle on the
  /// rounded values).
  AttentionRun(const testkit::AttentionShape& shape, bool backward, Isa isa, int threads,
               const BenchVariants& variants = {}, DType dtype = DType::f32);
  void forward();  ///< attention_forward: O and L (what backward starts from)
  void call();     ///< the timed call: forward, or backward from the O and L of forward()
  double useful_flops() const;
  /// Useful FLOPs (SPEC "Useful-work counts"): only the pairs the causal mask and the window
  /// leave visible count; backward = 2.5 × forward.
  /// rel_err (testkit) of batch 0, the g query heads of KV head 0, 32 query rows (dQ, and for
  /// causal bottom-right T_q = T_k also dK, dV of the last 32 keys) vs reference::attention_*,
  /// with the same score variants.
  double slice_error() const;

 private:
  testkit::AttentionShape shape_;
  bool backward_;
  BenchVariants variants_;
  std::vector<float> alibi_, sinks_;  // what options_ views
  AttentionOptions options_;
  DType dtype_ = DType::f32;
  std::vector<float> q_, k_, v_, o_, lse_, dout_, dq_, dk_, dv_;
  // bf16 / f16: the tensors the calls see (q_, ... hold the same values widened, for the oracle)
  std::vector<std::uint16_t> q16_, k16_, v16_, o16_, dout16_, dq16_, dk16_, dv16_;
  template <class V>
  V view(std::vector<float>& x32, std::vector<std::uint16_t>& x16, std::int64_t T,
         std::int64_t H) const;
};

/// Runs every case of `config`, printing a table (or JSON lines) to `out` as it goes.
std::vector<BenchResult> run(const BenchConfig& config, std::ostream& out);

std::string to_json(const BenchResult& r);

}  // namespace tokenmix::bench
