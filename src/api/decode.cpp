// src/api/decode.cpp — attention_decode: validate, split the keys into fixed chunks, run the
// kernel of the chosen ISA on every (sequence, KV head, query block, chunk) unit, then merge the
// chunks of each row in chunk order (SPEC "Merging partial results").
//
// Merge in the kernels' (m, l, Õ) form, with L = m + log l (4.4):
//   m = max(m¹, m²),  l = l¹ e^{m¹−m} + l² e^{m²−m},  Õ = Õ¹ e^{m¹−m} + Õ² e^{m²−m}
// which is L = log(e^{L¹} + e^{L²}), O = e^{L¹−L} O¹ + e^{L²−L} O² with O = Õ / l; a part with
// m = −∞ (no visible key) contributes nothing. The chunk size depends only on the problem, never
// on the thread count, and each row is merged left to right by one thread: the result is
// bitwise identical for any number of threads.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "kernels/attention_kernels.hpp"
#include "kernels/kv_element.hpp"
#include "kernels/nonfinite.hpp"
#include "kernels/registry.hpp"
#include "kernels/scratch_arena.hpp"
#include "model/kv_cache_access.hpp"
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

}  // namespace

std::uint64_t decode_bytes(const KVCache& cache, std::int64_t layer, std::int64_t first_seq,
                           std::int64_t batch) {
  const KVCacheConfig& c = cache.config();
  if (first_seq < 0 || batch < 0 || first_seq > c.batch || batch > c.batch - first_seq) {
    fail(ErrorCode::invalid_argument, "decode_bytes",
         "sequences [first_seq, first_seq + batch) must lie in [0, batch = " + str(c.batch) +
             "); got first_seq = " + str(first_seq) + ", batch = " + str(batch));
  }
  std::uint64_t tokens = 0;
  for (std::int64_t b = first_seq; b < first_seq + batch; ++b)
    tokens += static_cast<std::uint64_t>(cache.length(b, layer));
  // 2 · Σ_b L_b · H_kv · d_h · sizeof  (SPEC "Useful-work counts", decode bytes)
  return 2 * tokens * static_cast<std::uint64_t>(c.heads_kv * c.head_dim) * size_of(c.dtype);
}

void attention_decode(ConstTensorView q, const KVCache& cache, std::int64_t layer, TensorView out,
                      TensorView lse, const DecodeOptions& o) {
  constexpr const char* fn = "attention_decode";
  const KVCacheConfig& cc = cache.config();
  if (layer < 0 || layer >= cc.layers) {
    fail(ErrorCode::invalid_argument, fn,
         "layer must be in [0, layers = " + str(cc.layers) + "); got " + str(layer));
  }
  detail::check_activation(q, 4, fn, "q");  // f32, bf16 or f16 on any cache dtype
  kernels::DecodeArgs a;
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
  const DType act = detail::common_dtype(fn, {{"q", q}, {"out", out}}, "q and out");
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
  std::int64_t max_len = 0;
  for (std::int64_t b = o.first_seq; b < o.first_seq + a.batch; ++b) {
    if (!cache.active(b)) {
      fail(ErrorCode::invalid_argument, fn,
           "sequence " + str(b) +
               " was released; its keys and values are gone (reset it to reuse the slot)");
    }
    max_len = std::max(max_len, cache.length(b, layer));
  }
  const double scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(a.dh)));
  if (!std::isfinite(scale) || !std::isfinite(static_cast<float>(scale))) {
    fail(ErrorCode::invalid_argument, fn,
         "options.scale must be finite in float32; got " + std::to_string(scale));
  }
  if (o.threads < 0)
    fail(ErrorCode::invalid_argument, fn,
         "options.threads must be >= 0 (0 = all); got " + str(o.threads));
  const Isa isa = resolve_isa(o.isa, fn);  // the one dispatch decision of this call
  if (a.batch == 0 || a.tnew == 0 || a.hq == 0) return;

  a.scale = static_cast<float>(scale);
  a.dtype = cc.dtype;
  a.layout = Access::layout(cache);
  a.k_layer = Access::layer(cache, layer);  // K tiles from here, V tiles one tile later
  a.v_layer = Access::layer(cache, layer) + a.layout.tile_elems() * size_of(a.dtype);
  a.table = Access::table(cache, o.first_seq);
  a.table_width = Access::table_width(cache);
  a.lengths = Access::lengths(cache, layer) + o.first_seq;
  a.q = strided(q);
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
  const std::int64_t g = a.group();
  a.qblock = std::max<std::int64_t>(1, std::min(a.tnew, kMaxRows / g));
  a.qblocks = (a.tnew + a.qblock - 1) / a.qblock;
  a.chunk = kChunkKeys;
  a.chunks = std::max<std::int64_t>(1, (max_len + a.chunk - 1) / a.chunk);
  a.threads = o.threads == 0 ? default_threads() : o.threads;
  const std::int64_t units = a.units(), rows = a.rows_max();
  const int team = static_cast<int>(std::clamp<std::int64_t>(a.threads, 1, units));
  // The kernel for this path and the cache's dtype (kernels/registry.cpp).
  const auto named = kernels::select_decode(fn, isa, cc.dtype);
  const kernels::DecodeKernel kernel = named.fn;
  // One buffer, allocated here (an allocation failure throws ResourceError in the caller's
  // thread) and reused across calls: per-worker scratch regions (DecodeScratch), then the
  // partials (Õ, m, l) of every unit.
  const kernels::CallSite site{fn, named.name};
  kernels::ScratchLayout worker_layout(site);
  a.slots = kernels::DecodeScratch(worker_layout, rows, a.dh);
  const auto merge_slot = worker_layout.add<float>(a.dh);  // the merge's running Õ of one row
  kernels::ScratchLayout partials_layout(site);
  const std::int64_t part_rows = kernels::scratch_mul(units, rows, site, "decode partials");
  const auto acc_slot =
      partials_layout.add<float>(kernels::scratch_mul(part_rows, a.dh, site, "decode partials"));
  const auto m_slot = partials_layout.add<float>(part_rows);
  const auto l_slot = partials_layout.add<float>(part_rows);
  const std::int64_t workers_bytes =
      kernels::scratch_mul(team, worker_layout.bytes(), site, "decode scratch");
  std::byte* base = partials_buffer().reserve(
      kernels::scratch_add(workers_bytes, partials_layout.bytes(), site, "decode scratch"), site,
      "the per-worker scratch and the partial results");
  a.scratch = {base, worker_layout.bytes()};
  const kernels::WorkerScratch partials{base + workers_bytes, 0};
  a.part_acc = partials.at(acc_slot, 0);
  a.part_m = partials.at(m_slot, 0);
  a.part_l = partials.at(l_slot, 0);

  auto* po = static_cast<float*>(out.data);
  auto* pl = static_cast<float*>(lse.data);
  const std::int64_t groups = a.batch * a.hkv * a.qblocks;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  // One parallel region per call (waking workers is the costly part on a busy machine): the
  // kernel shares out the units (its `omp for` ends with a barrier), then the merge.
#pragma omp parallel num_threads(team)
  {
    kernel(a);
    // Merge the chunks of every row in chunk order and normalise: O = Õ / l, L = m + log l.
    float* const acc = a.scratch.at(merge_slot, omp_get_thread_num());  // [d_h]
#pragma omp for schedule(static)
    for (std::int64_t grp = 0; grp < groups; ++grp) {
      const std::int64_t qb = grp % a.qblocks, j = (grp / a.qblocks) % a.hkv,
                         b = grp / (a.qblocks * a.hkv);
      for (std::int64_t r = 0; r < rows; ++r) {
        const std::int64_t t = qb * a.qblock + r / g, h = j * g + r % g;
        if (t >= a.tnew) break;
        // Chunks the row sees no key of take no part. Every other chunk is merged arithmetically
        // (SPEC "Merging partial results"), even one whose keys all scored −∞ (m_c = −∞, l_c = 0):
        // its Õ_c is 0, or NaN if a visible v was NaN (0 · NaN = NaN), and is weighted by 0, not
        // skipped. m is a NaN-propagating max, so a NaN part makes the row NaN (SPEC 4.3).
        const std::int64_t seen = a.visible_end(b, t);  // keys [0, seen) are visible to row t
        float m = kNegInf, l = 0.0f;
        std::fill(acc, acc + a.dh, 0.0f);
        bool first = true;
        for (std::int64_t c = 0; c < a.chunks && c * a.chunk < seen; ++c) {
          const std::int64_t unit = grp * a.chunks + c;
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
  }
}

}  // namespace tokenmix
