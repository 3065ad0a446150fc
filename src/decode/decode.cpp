// src/decode/decode.cpp — attention_decode: validate, split the keys into fixed chunks, run the
// kernel of the chosen ISA on every (sequence, KV head, query block, chunk) unit, then merge the
// chunks of each row in chunk order (SPEC "Merging partial results").
//
// Merge in the kernels' (m, l, Õ) form, with L = m + log l (4.4):
//   m = max(m¹, m²),  l = l¹ e^{m¹−m} + l² e^{m²−m},  Õ = Õ¹ e^{m¹−m} + Õ² e^{m²−m}
// which is L = log(e^{L¹} + e^{L²}), O = e^{L¹−L} O¹ + e^{L²−L} O² with O = Õ / l; a part with
// m = −∞ (no visible key) contributes nothing. The chunk size depends only on the problem, never
// on the thread count, and each row is merged left to right by one thread: the result is
// bitwise identical for any number of threads. Attention sinks (SPEC "Score variants") join the
// merged row as one more part with m = σ_h, l = 1, Õ = 0: L = log(e^{σ_h} + Σ_u e^{S_u}), O
// unchanged in form; a row that sees no key gets O = 0, L = σ_h.
//
// With a window W the keys of sequence b are chunked from chunk_base(b), the key tile holding the
// first query's window start, so chunks and tiles before the window are never read.
//
// Batches of mixed lengths: each sequence has the chunks its own keys need (at least one), and
// units exist only for those (DecodeArgs::chunk_first, a prefix sum filled per call into the
// partials buffer), so the work is shared out by keys, not by B × the longest sequence. A unit
// whose query block sees no key of its chunk (early blocks of a long T_new, a window) leaves
// before any per-row work.
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "decode/decode_internal.hpp"
#include "decode/kv_cache_access.hpp"
#include "dispatch/cpu_cap.hpp"
#include "dispatch/registry.hpp"
#include "kernels/attention_kernels.hpp"
#include "kernels/kv_element.hpp"
#include "kernels/nonfinite.hpp"
#include "kernels/scratch_arena.hpp"
#include "tokenmix/error.hpp"
#include "tokenmix/kv_cache.hpp"
#include "util/validate.hpp"

namespace tokenmix {
namespace {

using detail::fail;
using Access = detail::KVCacheAccess;
std::string str(std::int64_t x) {
  return std::to_string(x);
}

constexpr std::int64_t kChunkKeys = 1024;  // keys per split (16 key tiles): fixed, see top
constexpr std::int64_t kMaxRows = 128;     // g · query positions per unit (bounds unit scratch)

// Chunks of a sequence with `keys` keys from its chunk base (≥ 1: a sequence's units exist even
// when it has no key; they find nothing visible and leave at once).
std::int64_t chunks_for(std::int64_t keys) {
  return std::max<std::int64_t>(1, (keys + kChunkKeys - 1) / kChunkKeys);
}

template <class V>
auto strided(const V& v) {
  using Ptr =
      std::conditional_t<std::is_same_v<decltype(v.data), const void*>, const float*, float*>;
  return kernels::Strided<Ptr>{static_cast<Ptr>(v.data), v.strides[0], v.strides[1], v.strides[2],
                               v.strides[3]};
}

// Per-thread reusable scratch + partials buffer (the decode step runs every token: no
// allocation, no page faults once warm).
kernels::ReusableScratch& partials_buffer() {
  thread_local kernels::ReusableScratch buf;
  return buf;
}

std::atomic<std::int64_t> scratch_limit_for_testing{-1};  // detail::set_decode_scratch_limit_…

// Checks a rank-1 [H_q] f32 option (ALiBi slopes, sinks), any stride. As for attention_forward
// (src/api/variants.cpp), values are data: NaN and ±∞ propagate as IEEE arithmetic says.
void check_head_vector(const char* fn, const char* name, const ConstTensorView& v,
                       std::int64_t hq) {
  if (v.empty()) return;
  detail::check_view(v, 1, fn, name);
  detail::check_dim(v, 0, hq, fn, name, "H_q", "q.shape[2]");
}

// A validated decode call, its work split and the scratch it needs (make_plan): the same for the
// call itself and for prepare_decode, which plans it before the layer appends.
struct Plan {
  kernels::DecodeArgs a;
  kernels::NamedKernel<kernels::DecodeKernel> named;
  bool empty = false;      // no query row: nothing to compute
  DType act = DType::f32;  // the dtype of q and out (SPEC "Reduced precision")
  int team = 1;
  kernels::ScratchLayout worker_layout, partials_layout;
  kernels::Slot<float> merge_slot, acc_slot, m_slot, l_slot, alibi_slot, sinks_slot;
  kernels::Slot<std::int64_t> first_slot;  // DecodeArgs::chunk_first, [B + 1]
  std::int64_t workers_bytes = 0, total_bytes = 0;
};

// Validates the call against the cache as it is after `pending` more positions per sequence
// (0: as it is now) and sizes the work and the scratch. Reads nothing but sizes from the cache.
Plan make_plan(const char* fn, const ConstTensorView& q, const KVCache& cache, std::int64_t layer,
               const TensorView& out, const TensorView& lse, const DecodeOptions& o,
               std::int64_t pending) {
  const KVCacheConfig& cc = cache.config();
  if (layer < 0 || layer >= cc.layers) {
    fail(ErrorCode::invalid_argument, fn,
         "layer must be in [0, layers = " + str(cc.layers) + "); got " + str(layer));
  }
  detail::check_activation(q, 4, fn, "q");  // f32, bf16 or f16 on any cache dtype
  Plan plan;
  kernels::DecodeArgs& a = plan.a;
  a.batch = q.dim(0);
  a.tnew = q.dim(1);
  a.hq = q.dim(2);
  a.dh = q.dim(3);
  a.hkv = cc.heads_kv;
  if (o.first_seq < 0 || o.first_seq > cc.batch || a.batch > cc.batch - o.first_seq) {
    fail(ErrorCode::invalid_argument, fn,
         "sequences [options.first_seq, options.first_seq + q.shape[0]) must lie in [0, batch = " +
             str(cc.batch) + "); got first_seq = " + str(o.first_seq) +
             ", q.shape[0] = " + str(a.batch));
  }
  if (a.hq < a.hkv || a.hq % a.hkv != 0) {
    fail(ErrorCode::shape_mismatch, fn,
         "q.shape[2] (H_q) must be a multiple of the cache's heads_kv = " + str(a.hkv) +
             " (SPEC 4.8); got H_q = " + str(a.hq));
  }
  detail::check_dim(q, 3, cc.head_dim, fn, "q", "d_h", "the cache's head_dim");
  detail::check_activation(out, 4, fn, "out");
  // SPEC "Reduced precision": out has the dtype of q; lse is f32.
  plan.act = detail::common_dtype(fn, {{"q", q}, {"out", out}}, "q and out");
  for (int axis = 0; axis < 4; ++axis) {
    const char* names[] = {"B", "T_new", "H_q", "d_h"};
    detail::check_dim(out, axis, q.dim(axis), fn, "out", names[axis],
                      ("q.shape[" + str(axis) + "]").c_str());
  }
  if (!lse.empty()) {
    detail::check_view(lse, 3, fn, "lse");
    detail::check_dim(lse, 0, a.batch, fn, "lse", "B", "q.shape[0]");
    detail::check_dim(lse, 1, a.hq, fn, "lse", "H_q", "q.shape[2]");
    detail::check_dim(lse, 2, a.tnew, fn, "lse", "T_new", "q.shape[1]");
  }
  detail::check_no_overlap(fn, {{"out", out}, {"lse", lse}}, {{"q", q}});
  // The cache's storage is owned by the cache: outputs cannot overlap it unless the caller
  // points them into raw_storage(), which is const.
  const double scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(a.dh)));
  if (!std::isfinite(scale) || !std::isfinite(static_cast<float>(scale))) {
    fail(ErrorCode::invalid_argument, fn,
         "options.scale must be finite in float32; got " + std::to_string(scale));
  }
  if (o.threads < 0)
    fail(ErrorCode::invalid_argument, fn,
         "options.threads must be >= 0 (0 = all); got " + str(o.threads));
  // Score variants (SPEC "Score variants used by real models").
  if (o.window && *o.window < 1) {
    fail(ErrorCode::invalid_argument, fn,
         "options.window must be >= 1 (the last W positions up to the query's); got " +
             str(*o.window));
  }
  if (o.softcap &&
      !(std::isfinite(*o.softcap) && *o.softcap > 0.0 &&
        std::isfinite(static_cast<float>(*o.softcap)) && static_cast<float>(*o.softcap) > 0.0f)) {
    fail(ErrorCode::invalid_argument, fn,
         "options.softcap must be finite and > 0 in float32; got " + std::to_string(*o.softcap));
  }
  check_head_vector(fn, "options.alibi_slopes", o.alibi_slopes, a.hq);
  check_head_vector(fn, "options.sinks", o.sinks, a.hq);
  const std::int64_t ring = Access::ring(cache);
  if (ring != 0 && !o.window) {
    fail(ErrorCode::invalid_argument, fn,
         "options.window is required on a rolling cache (config.window = " + str(cc.window) +
             ": it keeps only the last " + str(ring) +
             " positions of each sequence); got no window");
  }
  if (ring != 0 && *o.window > cc.window) {
    fail(ErrorCode::invalid_argument, fn,
         "options.window must be <= the rolling cache's config.window = " + str(cc.window) +
             "; got " + str(*o.window));
  }
  // A window longer than any sequence is no restriction; 2^62 keeps p − W + 1 from overflowing
  // (as attention_forward's).
  a.var.window = std::min<std::int64_t>(o.window.value_or(0), std::int64_t{1} << 62);
  std::int64_t max_keys = 0;      // keys of the longest sequence from its chunk base
  std::int64_t total_chunks = 0;  // Σ_b chunks of sequence b (DecodeArgs::chunk_first)
  for (std::int64_t b = o.first_seq; b < o.first_seq + a.batch; ++b) {
    if (!cache.active(b)) {
      fail(ErrorCode::invalid_argument, fn,
           "sequence " + str(b) +
               " was released; its keys and values are gone (reset it to reuse the slot)");
    }
    const std::int64_t len = cache.length(b, layer) + pending;  // ≤ capacity: checked by caller
    // The first key the call's first query sees, and its tile (kernels::DecodeArgs::chunk_base).
    const std::int64_t begin =
        a.var.window > 0 ? std::max<std::int64_t>(0, len - a.tnew + 1 - a.var.window) : 0;
    if (ring != 0) {
      const std::int64_t held = std::max(cache.first_position(b, layer), len - ring);
      if (begin < held) {
        fail(ErrorCode::invalid_argument, fn,
             "T_new = " + str(a.tnew) + " queries with options.window = " + str(a.var.window) +
                 " need positions from " + str(begin) + " of sequence " + str(b) +
                 ", but the rolling cache holds them from " + str(held) +
                 " on (it keeps the last " + str(ring) + "; at most " +
                 str(ring - a.var.window + 1) + " new tokens per call)");
      }
    }
    const std::int64_t keys = len - begin / kernels::kDecodeKeyTile * kernels::kDecodeKeyTile;
    max_keys = std::max(max_keys, keys);
    total_chunks += chunks_for(keys);
  }
  const Isa isa = resolve_isa(o.isa, fn);  // the one dispatch decision of this call
  plan.empty = a.batch == 0 || a.tnew == 0 || a.hq == 0;
  if (plan.empty) return plan;

  a.scale = static_cast<float>(scale);
  if (o.softcap) a.var.softcap = static_cast<float>(*o.softcap);
  a.ring = ring;
  a.dtype = cc.dtype;
  // The kernel and its per-CPU choices, decided once (dispatch/cpu_cap.hpp, choose_decode).
  const detail::DecodeChoice choice = detail::choose_decode(fn, isa, cc.dtype, cache.int8_quads());
  a.fp8_direct = choice.fp8_direct;
  a.linear_prefetch = choice.linear_prefetch;
  a.amx = choice.amx;
  const std::int64_t g = a.group();
  a.qblock = std::max<std::int64_t>(1, std::min(a.tnew, kMaxRows / g));
  a.qblocks = (a.tnew + a.qblock - 1) / a.qblock;
  a.chunk = kChunkKeys;
  a.chunks = chunks_for(max_keys);  // the longest sequence's; each has its own (chunk_first)
  a.threads = o.threads == 0 ? default_threads() : o.threads;
  // Units only for the chunks each sequence has (a.units() once chunk_first is filled).
  const std::int64_t units = total_chunks * a.hkv * a.qblocks, rows = a.rows_max();
  plan.team = static_cast<int>(std::clamp<std::int64_t>(a.threads, 1, units));
  plan.named = choice.kernel;
  // One buffer, reused across calls: per-worker scratch regions (DecodeScratch), then the
  // partials (Õ, m, l) of every unit and the contiguous [H_q] slopes and sinks.
  const kernels::CallSite site{fn, plan.named.name};
  plan.worker_layout = kernels::ScratchLayout(site);
  a.slots = kernels::DecodeScratch(plan.worker_layout, rows, a.dh);
  plan.merge_slot = plan.worker_layout.add<float>(a.dh);  // the merge's running Õ of one row
  plan.partials_layout = kernels::ScratchLayout(site);
  const std::int64_t part_rows = kernels::scratch_mul(units, rows, site, "decode partials");
  plan.acc_slot = plan.partials_layout.add<float>(
      kernels::scratch_mul(part_rows, a.dh, site, "decode partials"));
  plan.m_slot = plan.partials_layout.add<float>(part_rows);
  plan.l_slot = plan.partials_layout.add<float>(part_rows);
  plan.alibi_slot = plan.partials_layout.add<float>(o.alibi_slopes.empty() ? 0 : a.hq);
  plan.sinks_slot = plan.partials_layout.add<float>(o.sinks.empty() ? 0 : a.hq);
  plan.first_slot = plan.partials_layout.add<std::int64_t>(a.batch + 1);
  plan.workers_bytes =
      kernels::scratch_mul(plan.team, plan.worker_layout.bytes(), site, "decode scratch");
  plan.total_bytes = kernels::scratch_add(plan.workers_bytes, plan.partials_layout.bytes(), site,
                                          "decode scratch");
  return plan;
}

// The plan's scratch, in this thread's reusable buffer (allocated here: an allocation failure
// throws ResourceError in the caller's thread, before anything is written).
std::byte* reserve(const Plan& plan) {
  const kernels::CallSite site{plan.worker_layout.site()};
  const char* what = "the per-worker scratch and the partial results";
  const std::int64_t limit = scratch_limit_for_testing.load();
  if (limit >= 0 && plan.total_bytes > limit) {
    throw ResourceError(ErrorCode::out_of_memory, std::string(site.entry) + ": cannot allocate " +
                                                      std::to_string(plan.total_bytes) +
                                                      " bytes for " + what + " of kernel " +
                                                      site.kernel + " (the test limit is " +
                                                      std::to_string(limit) + " bytes)");
  }
  return partials_buffer().reserve(plan.total_bytes, site, what);
}

}  // namespace

std::uint64_t decode_bytes(const KVCache& cache, std::int64_t layer, std::int64_t first_seq,
                           std::int64_t batch, std::int64_t window, std::int64_t tnew) {
  constexpr const char* fn = "decode_bytes";
  const KVCacheConfig& c = cache.config();
  if (first_seq < 0 || batch < 0 || first_seq > c.batch || batch > c.batch - first_seq) {
    fail(ErrorCode::invalid_argument, fn,
         "sequences [first_seq, first_seq + batch) must lie in [0, batch = " + str(c.batch) +
             "); got first_seq = " + str(first_seq) + ", batch = " + str(batch));
  }
  if (window < 0)
    fail(ErrorCode::invalid_argument, fn, "window must be >= 0 (0 = none); got " + str(window));
  if (tnew < 1) fail(ErrorCode::invalid_argument, fn, "tnew must be >= 1; got " + str(tnew));
  // 2 · Σ_b n_b · H_kv · d_h · sizeof  (SPEC "Useful-work counts", decode bytes). A quantized
  // cache counts what is read (SPEC "Quantized KV cache"): V's elements and row scales; K's
  // elements and the d_h channel scales of each closed tile touched, and the open tile's keys
  // in fp32.
  const bool quantized = kernels::is_quantized(c.dtype);
  const auto D = static_cast<std::uint64_t>(c.head_dim);
  std::uint64_t bytes = 0;
  for (std::int64_t b = first_seq; b < first_seq + batch; ++b) {
    const std::int64_t len = cache.length(b, layer);
    std::int64_t n = len - cache.first_position(b, layer);
    if (window > 0) n = std::min(n, window > INT64_MAX - tnew ? INT64_MAX : window + tnew - 1);
    if (!quantized) {
      bytes += 2 * static_cast<std::uint64_t>(n) * D * size_of(c.dtype);
      continue;
    }
    constexpr std::int64_t kT = KVCache::kKeyTile;
    const std::int64_t from = len - n, open = len / kT * kT;  // open tile: keys [open, len)
    const std::int64_t closed = std::max<std::int64_t>(0, open - from);
    const std::int64_t tiles = closed == 0 ? 0 : (open - from + from % kT + kT - 1) / kT;
    bytes += static_cast<std::uint64_t>(n) * (D + 4) + static_cast<std::uint64_t>(closed) * D +
             static_cast<std::uint64_t>(tiles) *
                 static_cast<std::uint64_t>(kernels::KVTileLayout::key_scale_bytes(c.head_dim)) +
             static_cast<std::uint64_t>(len - std::max(open, from)) * D * 4;
  }
  return bytes * static_cast<std::uint64_t>(c.heads_kv);
}

namespace detail {

void prepare_decode(const char* fn, ConstTensorView q, const KVCache& cache, std::int64_t layer,
                    TensorView out, TensorView lse, const DecodeOptions& options,
                    std::int64_t pending) {
  const Plan plan = make_plan(fn, q, cache, layer, out, lse, options, pending);
  if (!plan.empty) reserve(plan);
}

void set_decode_scratch_limit_for_testing(std::int64_t bytes) {
  scratch_limit_for_testing.store(bytes < 0 ? -1 : bytes);
}

}  // namespace detail

void attention_decode(ConstTensorView q, const KVCache& cache, std::int64_t layer, TensorView out,
                      TensorView lse, const DecodeOptions& o) {
  constexpr const char* fn = "attention_decode";
  Plan plan = make_plan(fn, q, cache, layer, out, lse, o, 0);
  if (plan.empty) return;
  std::byte* const base = reserve(plan);
  kernels::DecodeArgs& a = plan.a;
  a.layout = Access::layout(cache);
  a.k_layer = Access::layer(cache, layer);  // K tiles from here, V tiles one tile later
  a.v_layer = Access::layer(cache, layer) + a.layout.k_span() * size_of(a.dtype);
  const float* open = Access::open_tiles(cache, layer);  // quantized: the open K tiles
  if (open != nullptr) a.k_open = open + o.first_seq * a.hkv * a.dh * kernels::kDecodeKeyTile;
  a.table = Access::table(cache, o.first_seq);
  a.table_width = Access::table_width(cache);
  a.lengths = Access::lengths(cache, layer) + o.first_seq;
  a.q = strided(q);
  const DType act = plan.act;
  // bf16/f16 queries: widened once into a contiguous fp32 [B, T_new, H_q, d_h] copy (a few rows:
  // the kernels then read fp32 queries whatever the cache's dtype); O is rounded on store.
  std::vector<float> q_wide;
  if (act != DType::f32) {
    q_wide.resize(static_cast<std::size_t>(a.batch * a.tnew * a.hq * a.dh));
    for (std::int64_t b = 0; b < a.batch; ++b)
      for (std::int64_t t = 0; t < a.tnew; ++t)
        for (std::int64_t h = 0; h < a.hq; ++h)
          for (std::int64_t x = 0; x < a.dh; ++x) {
            q_wide[static_cast<std::size_t>(((b * a.tnew + t) * a.hq + h) * a.dh + x)] =
                kernels::load_element(
                    act, q.data,
                    b * q.strides[0] + t * q.strides[1] + h * q.strides[2] + x * q.strides[3]);
          }
    a.q = {q_wide.data(), a.tnew * a.hq * a.dh, a.hq * a.dh, a.dh, 1};
  }
  a.scratch = {base, plan.worker_layout.bytes()};
  const kernels::WorkerScratch partials{base + plan.workers_bytes, 0};
  a.part_acc = partials.at(plan.acc_slot, 0);
  a.part_m = partials.at(plan.m_slot, 0);
  a.part_l = partials.at(plan.l_slot, 0);
  // Each sequence's chunks, from its own keys (as make_plan counted them).
  std::int64_t* first = partials.at(plan.first_slot, 0);
  first[0] = 0;
  for (std::int64_t b = 0; b < a.batch; ++b)
    first[b + 1] = first[b] + chunks_for(a.lengths[b] - a.chunk_base(b));
  a.chunk_first = first;
  // Contiguous copies of the [H_q] slopes and sinks (validated by make_plan; any stride).
  if (!o.alibi_slopes.empty()) {
    float* slopes = partials.at(plan.alibi_slot, 0);
    for (std::int64_t h = 0; h < a.hq; ++h)
      slopes[h] = static_cast<const float*>(o.alibi_slopes.data)[h * o.alibi_slopes.strides[0]];
    a.var.alibi = slopes;
  }
  if (!o.sinks.empty()) {
    float* sinks = partials.at(plan.sinks_slot, 0);
    for (std::int64_t h = 0; h < a.hq; ++h)
      sinks[h] = static_cast<const float*>(o.sinks.data)[h * o.sinks.strides[0]];
    a.var.sinks = sinks;
  }
  const kernels::DecodeKernel kernel = plan.named.fn;
  const auto merge_slot = plan.merge_slot;
  const std::int64_t groups = a.batch * a.hkv * a.qblocks;
  // One parallel region per call (waking workers is the costly part on a busy machine): the
  // kernel shares out the units (its `omp for` ends with a barrier), then the merge.
  std::atomic<bool> amx_refused{false};
  a.amx_refused = &amx_refused;
#pragma omp parallel num_threads(plan.team)
  {
    kernel(a);
    // Merge the chunks of every row in chunk order and normalise: O = Õ / l, L = m + log l.
    float* const acc = a.scratch.at(merge_slot, omp_get_thread_num());  // [d_h]
#pragma omp for schedule(static)
    for (std::int64_t grp = 0; grp < groups; ++grp)
      detail::merge_decode_group(a, grp, acc, plan.act, out, lse);
  }
  if (amx_refused.load()) {
    throw UnsupportedError(std::string(fn) +
                           ": Linux refused a worker thread the AMX tile data (arch_prctl) that "
                           "it had granted the process; out and lse are not valid. "
                           "TOKENMIX_DECODE_AMX=off avoids AMX");
  }
}

namespace detail {

void merge_decode_group(const kernels::DecodeArgs& a, std::int64_t grp, float* acc, DType act,
                        const TensorView& out, const TensorView& lse) {
  const std::int64_t rows = a.rows_max(), g = a.group();
  auto* po = static_cast<float*>(out.data);
  auto* pl = static_cast<float*>(lse.data);
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const std::int64_t qb = grp % a.qblocks, j = (grp / a.qblocks) % a.hkv,
                     b = grp / (a.qblocks * a.hkv);
  const std::int64_t base_b = a.chunk_base(b);
  for (std::int64_t r = 0; r < rows; ++r) {
    const std::int64_t t = qb * a.qblock + r / g, h = j * g + r % g;
    if (t >= a.tnew) break;
    // Chunks the row sees no key of take no part. Every other chunk is merged arithmetically
    // (SPEC "Merging partial results"), even one whose keys all scored −∞ (m_c = −∞, l_c = 0):
    // its Õ_c is 0, or NaN if a visible v was NaN (0 · NaN = NaN), and is weighted by 0, not
    // skipped. m is a NaN-propagating max, so a NaN part makes the row NaN (SPEC 4.3).
    const std::int64_t seen = a.visible_end(b, t), from = a.visible_begin(b, t);
    float m = kNegInf, l = 0.0f;
    std::fill(acc, acc + a.dh, 0.0f);
    bool first = true;
    for (std::int64_t c = 0; c < a.chunks_of(b) && base_b + c * a.chunk < seen; ++c) {
      if (base_b + (c + 1) * a.chunk <= from) continue;  // before the row's window
      const std::int64_t unit = a.unit_index(b, j, qb, c);
      const float mc = a.part_m[unit * rows + r];
      const float* oc = a.part_acc + (unit * rows + r) * a.dh;
      const float lc = a.part_l[unit * rows + r];
      if (first) {
        first = false;
        m = mc;
        l = lc;
        std::copy(oc, oc + a.dh, acc);
        continue;
      }
      const float mn = kernels::max_nan(m, mc), shift = kernels::softmax_shift(mn);
      const float w1 = std::exp(m - shift), w2 = std::exp(mc - shift);
      l = l * w1 + lc * w2;
      for (std::int64_t x = 0; x < a.dh; ++x) acc[x] = acc[x] * w1 + oc[x] * w2;
      m = mn;
    }
    if (a.var.sinks != nullptr) {  // the sink: one more part, m = σ_h, l = 1, Õ = 0
      const float sigma = a.var.sinks[h];
      const float mn = kernels::max_nan(m, sigma), shift = kernels::softmax_shift(mn);
      const float w1 = std::exp(m - shift);
      l = l * w1 + std::exp(sigma - shift);
      for (std::int64_t x = 0; x < a.dh; ++x) acc[x] *= w1;
      m = mn;
    }
    const float inv = kernels::inverse_sum(l);  // l = 0: O = 0 · Õ; l = NaN: O = NaN
    const std::int64_t orow = b * out.strides[0] + t * out.strides[1] + h * out.strides[2];
    if (act == DType::f32) {
      for (std::int64_t x = 0; x < a.dh; ++x) po[orow + x * out.strides[3]] = acc[x] * inv;
    } else {  // rounded once to bf16/f16 (nearest even)
      for (std::int64_t x = 0; x < a.dh; ++x)
        kernels::store_element(act, out.data, orow + x * out.strides[3], acc[x] * inv);
    }
    if (pl != nullptr) {
      pl[b * lse.strides[0] + h * lse.strides[1] + t * lse.strides[2]] =
          l == 0.0f ? kNegInf : m + std::log(l);
    }
  }
}

}  // namespace detail

}  // namespace tokenmix
