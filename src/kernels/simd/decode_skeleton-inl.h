// src/kernels/simd/decode_skeleton-inl.h — decode attention over a KVCache, SIMD (Highway): the
// DecodeUnits<Reader> skeleton, the unit and tile loop shared by every cache dtype; the Reader
// policy (decode_reader_*-inl.h) says how the cache's elements enter the products, and its
// product backend (decode_amx-inl.h) whether a unit runs on AMX tiles. Each
// attention_decode_<dtype>_hwy.cpp includes its reader once per target (x86: AVX-512 = AVX3,
// AVX2+FMA; AArch64: NEON) and exports DecodeUnits<its reader> as
// attention_decode_<dtype>_<avx512|avx2|neon> (the registry picks one): one translation unit per
// cache dtype, so they compile in parallel. Unit contract: DecodeArgs in attention_kernels.hpp;
// chunks are merged by src/decode/decode.cpp.
//
// A unit is (sequence b, KV head j, query block, chunk of ≤ 1024 keys). Its rows are all g query
// heads of group j × the block's query positions (r = t_local · g + h_local), so each K/V tile is
// read from memory once for the whole group (GQA: bytes do not grow with g). Workers take runs of
// consecutive units (DecodeArgs::run_units), i.e. consecutive chunks of one stream, so each
// worker's reads go on front to back and the prefetch runs on into its next chunk. Per 64-key tile,
// both products are the shared register-blocked microkernel (microkernel-inl.h), with the cache
// element type (fp32 / bf16 / f16 / int8 / fp8) as its B operand, widened to fp32 in registers:
//   S[r][u]  = Σ_x (scale·q_r)[x] · Kᵀ[x][u]   A = scale·Q rows, B = K tile [d_h][64]  (4.2)
//   Õ[r][x] += Σ_u P[r][u] · V[u][x]        A = P rows (broadcast),   B = V rows [64][d_h]  (4.5)
// Keys are lanes in the first product and features in the second — the cache stores K tiles
// transposed and V row-major for exactly this, so nothing is repacked per step (a short query
// block's V rows are even read in place from the caller's tensor, DecodeArgs::v_rows: the same
// products with the tensor's row stride for d_h). Between them, the score variants (SPEC "Score
// variants used by real models") on the S tile through variants-inl.h (ElementwiseDecodeRow:
// soft-capping S = c·tanh(S / c) and ALiBi S += m_h (u − p)) — then the online softmax per row
// (4.4): mask keys outside [visible_begin(r), visible_end(r)) to −∞ (4.3 and the sliding window),
// m' = max(m, max S), P = e^{S − m'}, l ← l e^{m − m'} + Σ P, Õ ← Õ e^{m − m'} (only when m
// grows). With a window, tiles before the first row's window start are not read.
// exp: SoftmaxExp (exp-inl.h, through ExpNaN), 0.85 ULP, exactly 0 for −∞.
//
// The Reader policy: its interface and the quantized caches' contract in decode_products-inl.h.
//
// Highway "-inl" header: once per target from a foreach_target TU, after the reader's header.
#if defined(TOKENMIX_KERNELS_SIMD_DECODE_SKELETON_INL_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef TOKENMIX_KERNELS_SIMD_DECODE_SKELETON_INL_H_
#undef TOKENMIX_KERNELS_SIMD_DECODE_SKELETON_INL_H_
#else
#define TOKENMIX_KERNELS_SIMD_DECODE_SKELETON_INL_H_
#endif

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

#include "hwy/highway.h"
#include "kernels/attention_kernels.hpp"
#include "kernels/kv_element.hpp"
#include "kernels/nonfinite.hpp"
#include "kernels/simd/decode_amx-inl.h"
#include "kernels/simd/decode_blocking-inl.h"
#include "kernels/simd/decode_products-inl.h"
#include "kernels/simd/nonfinite-inl.h"
#include "kernels/simd/variants-inl.h"
#include "kernels/simd/work_units.hpp"

HWY_BEFORE_NAMESPACE();
namespace tokenmix::kernels::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

template <class Reader>
void DecodeUnits(const DecodeArgs& a) {
  using TB = typename Reader::Elem;
  constexpr bool kQuant = Reader::kQuantized;
  const hn::ScalableTag<float> d;
  using VF = hn::Vec<decltype(d)>;
  const std::int64_t N = static_cast<std::int64_t>(hn::Lanes(d));
  constexpr std::int64_t kKeyTile = kDecodeKeyTile;  // keys per cache tile
  const std::int64_t units = a.units(), rows = a.rows_max(), dh = a.dh, g = a.group();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const TB* k_layer = static_cast<const TB*>(a.k_layer);
  const TB* v_layer = static_cast<const TB*>(a.v_layer);
  // V rows read in place (DecodeArgs::v_rows: a short query block's caller tensor) or from the
  // V tiles: keys u0.. of (b, j) start at vt, one key's row vld elements after the previous one.
  // A quantized cache's V rows need their tile's scales: never in place (read_v_in_place).
  const bool v_in_place = a.v_in_place();
  const TB* v_rows = static_cast<const TB*>(a.v_rows.data);
  const std::int64_t vld = a.v_stride();
  if constexpr (kQuant) {
    if (v_in_place) {
      throw UnsupportedError(
          "attention decode: a quantized cache's V rows cannot be read in place");
    }
  }
  // True if an element of V rows [lo, hi) from vt is not finite (a generic lambda: instantiated
  // for activation dtypes only, NonFiniteIn needs 2- or 4-byte elements): one range when the
  // rows are contiguous, row by row otherwise.
  const auto v_nonfinite = [&](const auto* vt, std::int64_t lo, std::int64_t hi) {
    if (vld == dh) return NonFiniteIn(vt, lo * dh, hi * dh);
    bool bad = false;
    for (std::int64_t u = lo; u < hi; ++u) bad |= NonFiniteIn(vt + u * vld, 0, dh);
    return bad;
  };
  // Prefetch distance: the first tile pair at least kAheadBytes on (an int8 / fp8 pair of 64
  // keys is about half a bf16 one, and one tile ahead was too short for it on AMD Zen 4: T_new = 1
  // at T_k = 32768, 2 threads, 5.5 → 4.1 ms with two).
  const std::int64_t pair_bytes = a.layout.pair_span() * static_cast<std::int64_t>(sizeof(TB));
  const std::int64_t ahead_tiles =
      std::max<std::int64_t>(1, (kAheadBytes + pair_bytes - 1) / pair_bytes);
  const std::int64_t dh_vec = dh / N * N;  // d_h in whole vectors (then a scalar tail)

  // Runs of consecutive units per worker (DecodeArgs::run_units): on AMD Zen 5, T_k = 32768,
  // T_new = 1, two threads, int8 1.94–2.00 → 1.43 ms, bf16 T_new = 4 5.6–7.6 → 5.1–5.2 ms
  // (docs/performance.md, D-decode-8).
  const std::int64_t run = DecodeArgs::run_units(units, omp_get_num_threads());
  Reader rd(a);
#pragma omp for schedule(dynamic, run)
  for (std::int64_t unit = 0; unit < units; ++unit) {
    const auto [c, qb, j, b] = a.unit_at(unit);
    // The next unit is this worker's (same run) and the next chunk of the same stream (units of
    // a (b, j, qb) are numbered by chunk: DecodeArgs::unit_index): the prefetch runs on into it
    // (stream_end) instead of stopping at this chunk's end.
    const bool next_chunk_mine = (unit + 1) % run != 0 && c + 1 < a.chunks_of(b);
    const int worker = omp_get_thread_num();
    float* qs = a.scratch.at(a.slots.q_scaled, worker);  // scale·Q, transposed: [d_h][nrows]
    float* st = a.scratch.at(a.slots.scores, worker);    // S, then P [rows][64]
    float* acc = a.part_acc + unit * rows * dh;          // Õ [rows][d_h]
    float* m_run = a.part_m + unit * rows;
    float* l_run = a.part_l + unit * rows;

    const std::int64_t t0 = qb * a.qblock, nrows = std::min(a.qblock, a.tnew - t0) * g;
    // Keys some row sees: [kbegin, kend); keys every row sees: [kfull_begin, kfull).
    const DecodeArgs::KeyRange keys = a.key_range(b, t0, nrows / g);
    const std::int64_t kend = keys.end, kfull = keys.full_end, kbegin = keys.begin,
                       kfull_begin = keys.full_begin;
    const std::int64_t k0 = a.chunk_base(b) + c * a.chunk, k1 = std::min(k0 + a.chunk, kend);
    const std::int64_t stream_end = next_chunk_mine ? std::min(k1 + a.chunk, kend) : k1;
    // From the tile holding the first visible key (a window's start) on.
    const std::int64_t kb = std::max(k0, kbegin / kKeyTile * kKeyTile);
    std::fill(m_run, m_run + nrows, kNegInf);  // m = −∞, l = 0: the part is empty until a key
    std::fill(l_run, l_run + nrows, 0.0f);
    // Nothing visible in this chunk (past the last key of this query block — early blocks of a
    // long T_new —, a sequence with no key yet, or before a window): out before any per-row
    // work. The merge reads no part of it.
    if (kb >= k1) continue;
    for (std::int64_t r = 0; r < nrows; ++r) {
      const float* q = a.q.row(b, t0 + r / g, j * g + r % g);
      for (std::int64_t x = 0; x < dh; ++x) qs[x * nrows + r] = a.scale * q[x * a.q.s3];
    }
    DecodeUnit du{&a, worker, b, j, t0, g, nrows, dh, dh_vec, qs, st, acc, false, 0};
    rd.BeginUnit(du, v_in_place);  // (the backend's claim first: the tiles read their own way)
    // Quantized: per channel, the rows' largest |scale·q| (the K readings' guards per tile).
    float* qcol = a.scratch.at(a.slots.q_colmax, worker);
    if constexpr (kQuant) {
      if (rd.KeyMax()) QueryColumnMax(d, qs, dh, nrows, qcol);
    }
    std::fill(acc, acc + nrows * dh, 0.0f);
    const bool capped = a.var.softcap > 0.0f;
    // Several row blocks: the tall blocking (see kRT), unless the reader keeps the regular one.
    du.tall = nrows > kRD && !rd.RegularOnly();
    du.w_blk = (du.tall ? kVT : kVD) * N;
    rd.SetBlocking(du);
    const VF cap = hn::Set(d, a.var.softcap), inv_cap = hn::Set(d, 1.0f / a.var.softcap);

    for (std::int64_t u0 = kb; u0 < k1; u0 += kKeyTile) {
      const std::int64_t nt = std::min(kKeyTile, k1 - u0);
      const std::int64_t tile = a.tile_offset(b, j, u0);
      const TB* kt = k_layer + tile;  // Kᵀ tile [d_h][64]
      const TB* vt = v_in_place ? v_rows + a.v_row(b, j, u0) : v_layer + tile;  // V [nt][d_h]
      // The tile ahead_tiles on in this chunk, or in the next one where this worker takes it next
      // (stream_end; none in the stream's last tiles): the microkernels prefetch it row by row
      // while they compute on this one, so a worker's forward stream is read ahead by at least
      // kAheadBytes.
      const std::int64_t u_ahead = u0 + ahead_tiles * kKeyTile;
      const bool has_next = u_ahead < stream_end;
      const std::int64_t next = has_next ? a.tile_offset(b, j, u_ahead) : 0;
      // kLinearPrefetch (V tiles in the cache, not rows in place): the whole next pair through the
      // cursor (the pf pointers are then null), a quantized pair's scales included. Not for int8 /
      // fp8 by default: their widening makes a step compute-bound, and the cursor's bookkeeping
      // measured 3–7 % slower there (Zen 3); per call on AVX-512 and AVX2 (kLinearByCall) every
      // dtype; and where the reader asks (LinearPrefetch(): an fp8 unit converting its tiles).
      const bool linear = !v_in_place && !rd.tiles.on() &&
                          (rd.LinearPrefetch() || (kLinearPrefetch<TB> && !kQuant) ||
                           (kLinearByCall && a.linear_prefetch));
      PrefetchCursor cursor;
      if (linear && has_next) {
        cursor.next = reinterpret_cast<const std::uint8_t*>(k_layer + next);
        cursor.end = cursor.next + pair_bytes;
      }
      PrefetchCursor* const cur = linear && has_next ? &cursor : nullptr;
      const TB* kt_next = has_next && !linear && !rd.tiles.on() ? k_layer + next : nullptr;
      const TB* vt_next = !has_next || linear || rd.tiles.on() ? nullptr
                          : v_in_place                         ? v_rows + a.v_row(b, j, u_ahead)
                                                               : v_layer + next;
      if (kQuant && has_next && !linear && !rd.tiles.on()) {  // its K (d_h) and V (64) scales
        for (std::int64_t o = 0; o < a.layout.k_scale_elems; o += 64)
          PrefetchStream(reinterpret_cast<const std::uint8_t*>(kt_next + a.layout.tile_elems()) +
                         o);
        for (std::int64_t o = 0; o < a.layout.v_scale_elems; o += 64)
          PrefetchStream(reinterpret_cast<const std::uint8_t*>(vt_next + a.layout.tile_elems()) +
                         o);
      }

      // S = (scale·Q) Kᵀ over the whole 64-key tile (lanes past the data are masked below)  (4.2)
      // Only the nv lanes that hold keys of this tile (whole vectors; all 64 but in a sequence's
      // last tile) are computed and passed over below: a short last tile (or a call with fewer
      // than 64 keys) costs its keys, not the tile. Lanes [nt, nv) are masked (partial is true).
      const std::int64_t nv = (nt + N - 1) / N * N;
      const auto* pair_next =
          has_next ? reinterpret_cast<const std::uint8_t*>(k_layer + next) : nullptr;
      const DecodeTile<TB> tl{u0, nt, nv, kt, vt, kt_next, vt_next, pair_next, pair_bytes, cur};
      // Quantized K (SPEC "Quantized KV cache"): a closed tile's channel scales δ_τ (after the K
      // tile) fold into the query rows once per tile and row (FoldKeyScales), then the reader's
      // one-byte product; the open tile (the sequence's last, still being filled) is read
      // unquantized from its fp32 staging copy (DecodeArgs::open_tile) by the float product.
      float k_post = 1.0f;  // S_u ← S_u · k_post (a power of two: the K reading's unit)
      if constexpr (kQuant) {
        if (u0 == a.open_start(b)) {
          constexpr const float* kNoPrefetch = nullptr;
          ScoreProduct(du, a.open_tile(b, j), kNoPrefetch, nv, nullptr);
        } else {
          float* qd = a.scratch.at(a.slots.q_folded, worker);  // [d_h][nrows]
          const auto* delta = reinterpret_cast<const float*>(kt + a.layout.tile_elems());
          const float up = rd.KeyTile(rd.KeyMax() ? FoldedKeyMax(d, qcol, delta, dh) : 0.0f);
          FoldKeyScales(d, qs, delta, rd.KeyFold(), up, dh, nrows, qd);
          DecodeUnit dk = du;
          dk.qs = qd;
          rd.Scores(dk, tl);
          k_post = rd.KeyPost();
        }
      } else {
        rd.Scores(du, tl);
      }
      // Tile crosses some row's end or window start: the mask pass below runs.
      const bool partial = u0 + kKeyTile > kfull || u0 < kfull_begin;
      // S_u ← S_u · k_post where the reading's unit is not folded into the rows: fused into the
      // row max pass below when no variant or mask pass comes first (the same products), else a
      // pass of its own.
      const bool post = kQuant && k_post != 1.0f;
      const bool fuse_ks = post && !capped && a.var.alibi == nullptr && !partial;
      const VF kpost = hn::Set(d, k_post);
      const auto scale_scores = [&](VF s_u) { return hn::Mul(s_u, kpost); };
      // V's row scales: P_u ← P_u · δ_u in the exp pass (after l takes the unscaled P), times
      // 1 / (what V's LoadB returns per q in this tile's reading).
      const float* vs =
          kQuant ? reinterpret_cast<const float*>(vt + a.layout.tile_elems()) : nullptr;
      const float v_elem_unit = rd.ValueUnit(du, tl, vs);
      const VF v_unit = hn::Set(d, 1.0f / v_elem_unit);
      if (post && !fuse_ks) {
        for (std::int64_t r = 0; r < nrows; ++r)
          for (std::int64_t i = 0; i < nv; i += N)
            hn::Store(scale_scores(hn::Load(d, st + r * kKeyTile + i)), d, st + r * kKeyTile + i);
      }

      // Score variants, mask (4.3, window) and online softmax (4.4), in groups of kSoftmaxGroup
      // rows: first each row's variants, mask and max m', then each row's exponentials, sum and
      // rescale. Every row goes through the same operations in the same order as row by row (the
      // same bits), but the group's reductions, and then its exps, are adjacent in the program,
      // so the core overlaps their latency chains instead of finishing one row's max → exp →
      // sum before the next row's starts. AMD Zen 4, one process alternating the two call by call
      // (the same output bits), hot (T_k = 2048, one thread), T_new = 1 / 2: AVX-512 0.96–0.99×
      // the time for every cache dtype, AVX2 forced 0.96–0.995×; T_new = 4 and 16 0.95–1.0×
      // (groups of 4 and 16 no better); T_k = 32768 from memory, two threads: within the noise
      // (docs/performance.md, D-softmax-2).
      constexpr std::int64_t kSoftmaxGroup = 8;
      float m_group[kSoftmaxGroup];
      for (std::int64_t r0 = 0; r0 < nrows; r0 += kSoftmaxGroup) {
        const std::int64_t r1 = std::min(nrows, r0 + kSoftmaxGroup);
        for (std::int64_t r = r0; r < r1; ++r) {
          rd.tiles.KeepAwake();
          float* score = st + r * kKeyTile;
          const std::int64_t t = t0 + r / g;
          const std::int64_t end = a.visible_end(b, t), begin = a.visible_begin(b, t);
          ElementwiseDecodeRow(d, score, nv, capped, cap, inv_cap, a.var.alibi != nullptr,
                               a.var.alibi != nullptr ? a.var.alibi[j * g + r % g] : 0.0f,
                               u0 - (end - 1));
          // Tile crosses some row's end or window start: −∞ for lanes outside [begin, end).
          if (partial) MaskDecodeRow(d, score, nv, begin - u0, end - u0);
          // The row's max (same order of Max either way); fuse_ks: S_u ← S_u · k_post on the way.
          const auto scaled = [&](std::int64_t i) {
            if (!fuse_ks) return hn::Load(d, score + i);
            const VF z = scale_scores(hn::Load(d, score + i));
            hn::Store(z, d, score + i);
            return z;
          };
          VF vmax = scaled(0);
          for (std::int64_t i = N; i < nv; i += N) vmax = hn::Max(vmax, scaled(i));
          m_group[r - r0] = max_nan(m_run[r], hn::GetLane(hn::MaxOfLanes(d, vmax)));
        }
        for (std::int64_t r = r0; r < r1; ++r) {
          float* score = st + r * kKeyTile;
          const float m_old = m_run[r], m_new = m_group[r - r0];
          // A row with nothing visible yet keeps P = 0 (shift 0: e^{−∞} = 0).
          const VF shift = hn::Set(d, m_new == kNegInf ? 0.0f : m_new);
          VF vsum = hn::Zero(d);
          for (std::int64_t i = 0; i < nv; i += N) {
            const VF p = ExpNaN(d, hn::Sub(hn::Load(d, score + i), shift));  // NaN score: l = NaN
            if constexpr (kQuant) {  // P_u δ_u for P V (V's row scales follow the tile); l: P_u
              hn::Store(hn::Mul(p, hn::Mul(hn::LoadU(d, vs + i), v_unit)), d, score + i);
            } else {
              hn::Store(p, d, score + i);
            }
            vsum = hn::Add(vsum, p);
          }
          if (m_new > m_old && m_old != kNegInf) {  // rescale Õ and l by e^{m − m'}
            const float alpha = std::exp(m_old - m_new);
            float* o = acc + r * dh;
            const VF va = hn::Set(d, alpha);
            std::int64_t x = 0;
            for (; x < dh_vec; x += N) hn::StoreU(hn::Mul(hn::LoadU(d, o + x), va), d, o + x);
            for (; x < dh; ++x) o[x] *= alpha;
            l_run[r] *= alpha;
          }
          l_run[r] += hn::GetLane(hn::SumOfLanes(d, vsum));
          m_run[r] = m_new;
        }
      }

      // Õ += P V over the tile's nt keys, d_h in register blocks, then single vectors, then
      // a scalar tail (d_h % Lanes)  (4.5)
      std::int64_t x0 = 0;
      // The V tile is consumed in sub-tiles of kSub keys, all d_h chunks of a sub-tile before the
      // next, so memory is read front to back (row-strided passes over the whole tile halve the
      // DRAM bandwidth a core gets).
      // Keys before kfull_begin and from kfull on are not seen by every row; if their V rows are
      // not finite, each row's product covers its own visible keys only (a masked key takes no
      // part: 0 · NaN = NaN).
      // A quantized V is finite (non-finite rows are refused on append): no scan.
      const std::int64_t first_partial = std::clamp<std::int64_t>(kfull - u0, 0, nt);
      const std::int64_t last_partial = std::clamp<std::int64_t>(kfull_begin - u0, 0, nt);
      bool v_bad = false;
      if constexpr (!kQuant) {  // (a backend's unit checks its tiles itself: amx::values)
        v_bad = !rd.tiles.on() &&
                (v_nonfinite(vt, 0, last_partial) || v_nonfinite(vt, first_partial, nt));
      }
      // The tall blocking is bound by FMAs, not by the stream (several query rows per key): it
      // takes the whole tile per call, so Õ is loaded and stored once per tile, not per kSub; so
      // does every unit of a narrow cache on AVX-512 (kWholeTilePVNarrow). The same k order for
      // every element of Õ either way (the same bits).
      const std::int64_t sub = du.tall || (kWholeTilePVNarrow && sizeof(TB) < 4) ? kKeyTile : kSub;
      if (rd.tiles.on()) {
        rd.tiles.Values(du, u0, nt, vt);
        continue;  // the next tile (d_h % 64 == 0: no scalar tail)
      }
      rd.PrepareValues(du, tl, vld);  // (fp8 tiles as bf16: the V tile converted once)
      for (std::int64_t k0 = 0; k0 < nt; k0 += sub) {
        const std::int64_t nk = std::min(sub, nt - k0);
        const TB* vk = vt + k0 * vld;
        if constexpr (!kQuant) {
          using TP = typename Reader::RowElem;
          if (v_bad) {
            x0 = VisibleValueRowsProduct(du, reinterpret_cast<const TP*>(vk), vld, u0, k0, nk);
            continue;
          }
        }
        const TB* vk_next = vt_next != nullptr ? vt_next + k0 * vld : nullptr;
        x0 = rd.Values(du, vk, vk_next, k0, nk, vld, cur);  // (4.5)
      }
      if (x0 < dh) {
        for (std::int64_t r = 0; r < nrows; ++r)  // visible keys only (0 · NaN = NaN)
          for (std::int64_t u = std::max<std::int64_t>(0, a.visible_begin(b, t0 + r / g) - u0);
               u < std::min(nt, a.visible_end(b, t0 + r / g) - u0); ++u) {
            const float p = st[r * kKeyTile + u];
            for (std::int64_t x = x0; x < dh; ++x) {
              const std::int64_t at = Reader::ValueIndex(a, u, x, vld);
              acc[r * dh + x] += p * (load_element(a.dtype, vt, at) * v_elem_unit);
            }
          }
      }
    }
    rd.EndUnit(du);  // Õ's blocked columns back in order (the split readings)
    rd.tiles.EndUnit(acc);
  }
  rd.tiles.EndCall();
}

}  // namespace tokenmix::kernels::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // include guard (per target)

// The three exports of one cache dtype's translation unit (its HWY_ONCE part): DecodeUnits<its
// reader> per target, attention_decode_<dtype>_<avx512|avx2|neon>, null where the target is not
// compiled. READER names the reader as seen from a target's namespace (e.g. FloatReader<float>).
#ifndef TOKENMIX_DECODE_KERNELS
#define TOKENMIX_DECODE_KERNELS(dtype, READER)           \
  const DecodeKernel attention_decode_##dtype##_avx512 = \
      TOKENMIX_SIMD_AVX512(DecodeUnits<N_AVX3::READER>); \
  const DecodeKernel attention_decode_##dtype##_avx2 =   \
      TOKENMIX_SIMD_AVX2(DecodeUnits<N_AVX2::READER>);   \
  const DecodeKernel attention_decode_##dtype##_neon =   \
      TOKENMIX_SIMD_NEON(DecodeUnits<N_NEON::READER>)
#endif
