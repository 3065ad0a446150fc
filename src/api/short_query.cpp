// src/api/short_query.cpp — attention_forward for short query blocks (T_q ≤ kShortQuery:
// generation's decode steps and small chunks) on plain strided tensors: split-KV over the
// decode kernels.
//
// The forward kernels stack a lane block's query rows (g heads × positions) in the SIMD lanes
// (64 on AVX-512) and share out (B, H_kv, query block) units: a decode step (T_q = 1) fills g of
// the lanes and leaves all but B·H_kv threads idle. The decode kernels (decode_skeleton-inl.h,
// the portable one) put the keys in the lanes instead and split the keys into chunks: units
// (b, KV head j, query block, chunk), each writing its partial (Õ, m, l); the chunks of each row
// are then merged in chunk order by detail::merge_decode_group (SPEC "Merging partial results"),
// attention_decode's own merge. The chunk size (kChunkKeys) is fixed, never derived from the
// thread count, so the result does not depend on it.
//
// The decode kernels read K in the KVCache's tile layout (kv_tile_layout.hpp: K tiles transposed
// [d_h][64]). The call's K rows, from the tile holding the first visible key on, are packed into
// that layout in the calling thread's reusable scratch (one pass over K, shared out over the
// team): one block per 64-key tile, the block table numbering the packed tiles of each sequence.
// V's rows are the P·V product's B operand as they are (rows of d_h features): when V's feature
// stride is 1 the kernels read them in place from the call's tensor (DecodeArgs::v_rows, row
// stride = V's position stride) and the scratch holds K tiles alone; otherwise V is packed too,
// into V tiles [64][d_h] after each K tile. Both read the same values in the same order: the
// results are bitwise the same.
//
// Alignment (SPEC 4.3): the decode kernels' query t of a sequence of L positions sits at p(t) =
// L − T_q + t and sees keys u ≤ p(t) (and p(t) − W < u with a window W). Bottom-right causal: L =
// T_k. Top-left causal with T_q ≤ T_k: L = T_q (the keys from T_q on, seen by no row, are not
// read). No causal mask with T_q = 1: L = T_k (with a window or ALiBi, which use p(t), only
// bottom-right: top-left puts that query at 0). Soft-capping, ALiBi (−m_h (p(t) − u)) and the
// window are the decode kernels' own, sinks the merge's. Explicit masks, key lengths and the
// cases above that the decode layout cannot express run the forward kernel
// (short_query_applies); so do calls whose packed K/V would exceed kMaxPackBytes (64 MiB: the
// copy must not double a large cache's memory) and the opt-in avx512_bf16 path for bf16
// (vdpbf16ps products).
#include "api/short_query.hpp"

#include <omp.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#include <xmmintrin.h>
#endif

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>

#include "decode/decode_internal.hpp"
#include "dispatch/registry.hpp"
#include "kernels/kernel_skeleton.hpp"
#include "kernels/scratch_arena.hpp"

namespace tokenmix::detail {
namespace {

constexpr std::int64_t kTile = kernels::kDecodeKeyTile;  // keys per packed tile (64)
constexpr std::int64_t kChunkKeys = 256;                 // keys per split: fixed, see top
constexpr std::int64_t kMaxRows = 128;                   // g · query positions per unit
constexpr double kMaxPackBytes = 64.0 * 1024 * 1024;     // packed K/V per call, at most

// L of the decode layout (see top).
std::int64_t sequence_length(const kernels::AttentionProblem& p) {
  return p.causal && p.align == CausalAlign::top_left ? p.tq : p.tk;
}

// The first key tile any row reads: the tile of the first query's window start (0 without one).
std::int64_t first_tile(const kernels::AttentionProblem& p) {
  const std::int64_t L = sequence_length(p);
  const std::int64_t begin =
      p.var.window > 0 ? std::max<std::int64_t>(0, L - p.tq + 1 - p.var.window) : 0;
  return begin / kTile;
}

// Copies keys [u0, u0 + n) (n ≤ 64) of KV head j of sequence b into a K tile [d_h][64] (zero
// past n) and, unless vt is null (V read in place), a V tile [64][d_h], bit for bit (E: the
// element's bits, 4 or 2 bytes).
template <class E>
void pack_tile(const kernels::In& k, const kernels::In& v, std::int64_t b, std::int64_t j,
               std::int64_t u0, std::int64_t n, std::int64_t dh, E* kt, E* vt) {
  const auto* kp = reinterpret_cast<const E*>(k.data);
  const auto* vp = reinterpret_cast<const E*>(v.data);
  std::int64_t u = 0;
#if defined(__SSE2__)
  if constexpr (sizeof(E) == 4) {  // 4 × 4 blocks transposed in registers (bits only moved)
    if (k.s3 == 1) {
      for (; u + 4 <= n; u += 4) {
        const E* r0 = kp + b * k.s0 + (u0 + u) * k.s1 + j * k.s2;
        const E *r1 = r0 + k.s1, *r2 = r1 + k.s1, *r3 = r2 + k.s1;
        std::int64_t x = 0;
        for (; x + 4 <= dh; x += 4) {
          __m128 a = _mm_castsi128_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + x)));
          __m128 c = _mm_castsi128_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r1 + x)));
          __m128 e = _mm_castsi128_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r2 + x)));
          __m128 f = _mm_castsi128_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r3 + x)));
          _MM_TRANSPOSE4_PS(a, c, e, f);
          _mm_storeu_si128(reinterpret_cast<__m128i*>(kt + x * kTile + u), _mm_castps_si128(a));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(kt + (x + 1) * kTile + u),
                           _mm_castps_si128(c));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(kt + (x + 2) * kTile + u),
                           _mm_castps_si128(e));
          _mm_storeu_si128(reinterpret_cast<__m128i*>(kt + (x + 3) * kTile + u),
                           _mm_castps_si128(f));
        }
        for (; x < dh; ++x) {
          kt[x * kTile + u] = r0[x];
          kt[x * kTile + u + 1] = r1[x];
          kt[x * kTile + u + 2] = r2[x];
          kt[x * kTile + u + 3] = r3[x];
        }
      }
    }
  }
#endif
  for (; u < n; ++u) {
    const E* row = kp + b * k.s0 + (u0 + u) * k.s1 + j * k.s2;
    for (std::int64_t x = 0; x < dh; ++x) kt[x * kTile + u] = row[x * k.s3];
  }
  // The SIMD decode kernels compute S over the whole vectors holding the tile's n keys (up to
  // n rounded up to 16 lanes, masked past n): those lanes hold zeros, not a previous call's bits.
  const std::int64_t lanes = std::min<std::int64_t>(kTile, (n + 15) / 16 * 16);
  if (n < lanes) {
    for (std::int64_t x = 0; x < dh; ++x)
      std::fill(kt + x * kTile + n, kt + x * kTile + lanes, E{});
  }
  if (vt == nullptr) return;
  for (u = 0; u < n; ++u) {
    const E* row = vp + b * v.s0 + (u0 + u) * v.s1 + j * v.s2;
    E* out = vt + u * dh;
    if (v.s3 == 1) {
      std::memcpy(out, row, static_cast<std::size_t>(dh) * sizeof(E));
    } else {
      for (std::int64_t x = 0; x < dh; ++x) out[x] = row[x * v.s3];
    }
  }
  // V rows past n are never read (the P·V product and the non-finite check stop at n keys).
}

// The calling thread's scratch of this path, reused across calls (no allocation once warm).
kernels::ReusableScratch& scratch_buffer() {
  thread_local kernels::ReusableScratch buf;
  return buf;
}

}  // namespace

bool short_query_applies(const kernels::AttentionProblem& p, Isa isa, DType dtype) {
  if (p.batch < 1 || p.tq < 1 || p.tq > kShortQuery || p.tk < 1) return false;
  const kernels::ScoreVariants& var = p.var;
  if (var.mask_kind != kernels::MaskKind::none || var.key_lengths != nullptr ||
      var.row_begin != nullptr || var.dropout.active) {  // (dropout: the full forward's)
    return false;
  }
  if (!p.causal && (p.tq != 1 || (p.align == CausalAlign::top_left &&
                                  (var.window > 0 || var.alibi != nullptr)))) {
    return false;
  }
  if (p.causal && p.align == CausalAlign::top_left && p.tq > p.tk) return false;
  if (isa == Isa::avx512_bf16 && dtype == DType::bf16) return false;  // opted into vdpbf16ps
  // The block table holds int32 block numbers (B · tiles of them).
  const std::int64_t tiles = (sequence_length(p) + kTile - 1) / kTile;
  if (tiles > INT32_MAX / p.batch) return false;
  // The packed copy of K and V stays bounded (the thread keeps its scratch for the next call).
  // Counted for both, V read in place or not (the problem does not carry V's strides): which
  // path runs does not depend on V's layout.
  const double packed = static_cast<double>(p.batch) * static_cast<double>(p.hkv) *
                        static_cast<double>(tiles - first_tile(p)) * 2.0 * kTile *
                        static_cast<double>(p.dh) * static_cast<double>(size_of(dtype));
  return packed <= kMaxPackBytes;
}

void short_query_forward(const kernels::ForwardArgs& args, Isa isa, const TensorView& out,
                         const TensorView& lse) {
  const kernels::AttentionProblem& p = args.p;
  const kernels::CallSite site = p.site;  // the entry point and its forward kernel's name
  const kernels::DecodeKernel kernel = kernels::select_decode(site.entry, isa, args.dtype).fn;
  const DType act = args.dtype;
  const std::int64_t esize = static_cast<std::int64_t>(size_of(act));

  kernels::DecodeArgs a;
  a.batch = p.batch;
  a.tnew = p.tq;
  a.hq = p.hq;
  a.hkv = p.hkv;
  a.dh = p.dh;
  a.scale = p.scale;
  a.var.window = p.var.window;
  a.var.softcap = p.var.softcap;
  a.var.alibi = p.var.alibi;
  a.var.sinks = p.var.sinks;
  a.dtype = act;
  const std::int64_t L = sequence_length(p), g = a.group();
  const std::int64_t tile0 = first_tile(p), tiles = (L + kTile - 1) / kTile;
  const std::int64_t packed = tiles - tile0;  // tiles per sequence from the first one read
  a.qblock = std::max<std::int64_t>(1, std::min(a.tnew, kMaxRows / g));
  a.qblocks = (a.tnew + a.qblock - 1) / a.qblock;
  a.chunk = kChunkKeys;
  a.chunks = std::max<std::int64_t>(1, (L - tile0 * kTile + a.chunk - 1) / a.chunk);
  a.layout.heads_kv = a.hkv;
  a.layout.head_dim = a.dh;
  a.layout.block_tokens = kTile;  // one tile per block
  a.layout.pool_blocks = a.batch * packed;
  a.table_width = tiles;
  const std::int64_t units = a.units(), rows = a.rows_max();
  const std::int64_t pack_items = a.batch * a.hkv * packed;
  const int team =
      static_cast<int>(std::clamp<std::int64_t>(p.threads, 1, std::max(units, pack_items)));
  a.threads = team;

  // V's rows in place (see top) when its features are contiguous; else packed into V tiles.
  const bool v_in_place = args.v.s3 == 1;
  if (v_in_place) a.read_v_in_place(args.v, site);

  // Scratch: per-worker regions (DecodeScratch, the merge's running Õ), then the partials of
  // every unit, the lengths, the block table, the packed K (and V) tiles and fp32 queries
  // (bf16/f16).
  kernels::ScratchLayout worker_layout(site);
  a.slots = kernels::DecodeScratch(worker_layout, rows, a.dh);
  const auto merge_slot = worker_layout.add<float>(a.dh);
  kernels::ScratchLayout shared(site);
  const std::int64_t part_rows = kernels::scratch_mul(units, rows, site, "split-KV partials");
  const auto acc_slot =
      shared.add<float>(kernels::scratch_mul(part_rows, a.dh, site, "split-KV partials"));
  const auto m_slot = shared.add<float>(part_rows);
  const auto l_slot = shared.add<float>(part_rows);
  const auto len_slot = shared.add<std::int64_t>(a.batch);
  const auto table_slot = shared.add<std::int32_t>(
      kernels::scratch_mul(a.batch, tiles, site, "the split-KV block table"));
  const std::int64_t tile_bytes =  // per (b, j, tile): a K tile (and a V tile)
      kernels::scratch_mul(
          kernels::scratch_mul((v_in_place ? 1 : 2) * kTile, a.dh, site, "packed K/V tiles"), esize,
          site, "packed K/V tiles");
  const auto kv_slot =
      shared.add<std::byte>(kernels::scratch_mul(pack_items, tile_bytes, site, "packed K/V tiles"));
  const auto q_slot = shared.add<float>(
      act == DType::f32
          ? 0
          : kernels::scratch_mul(kernels::scratch_mul(a.batch * a.tnew, a.hq, site, "queries"),
                                 a.dh, site, "fp32 queries"));
  const std::int64_t workers_bytes =
      kernels::scratch_mul(team, worker_layout.bytes(), site, "split-KV scratch");
  std::byte* const base = scratch_buffer().reserve(
      kernels::scratch_add(workers_bytes, shared.bytes(), site, "split-KV scratch"), site,
      "the split-KV (short query block) scratch and partial results");

  a.scratch = {base, worker_layout.bytes()};
  const kernels::WorkerScratch part{base + workers_bytes, 0};
  a.part_acc = part.at(acc_slot, 0);
  a.part_m = part.at(m_slot, 0);
  a.part_l = part.at(l_slot, 0);
  std::int64_t* const lengths = part.at(len_slot, 0);
  std::int32_t* const table = part.at(table_slot, 0);
  for (std::int64_t b = 0; b < a.batch; ++b) {
    lengths[b] = L;
    for (std::int64_t t = 0; t < tiles; ++t)  // tiles before tile0 are never read
      table[b * tiles + t] = static_cast<std::int32_t>(t < tile0 ? 0 : b * packed + t - tile0);
  }
  a.lengths = lengths;
  a.table = table;
  std::byte* const kv = part.at(kv_slot, 0);
  a.k_layer = kv;
  a.v_layer = v_in_place ? nullptr : kv + a.layout.tile_elems() * esize;
  a.q = args.q;
  if (act != DType::f32) {  // widened once (a few rows): the kernels read fp32 queries
    float* q = part.at(q_slot, 0);
    for (std::int64_t b = 0; b < a.batch; ++b)
      for (std::int64_t t = 0; t < a.tnew; ++t)
        for (std::int64_t h = 0; h < a.hq; ++h)
          for (std::int64_t x = 0; x < a.dh; ++x) {
            q[((b * a.tnew + t) * a.hq + h) * a.dh + x] = kernels::load_element(
                act, args.q.data, b * args.q.s0 + t * args.q.s1 + h * args.q.s2 + x * args.q.s3);
          }
    a.q = {q, a.tnew * a.hq * a.dh, a.hq * a.dh, a.dh, 1};
  }

  const std::int64_t groups = a.batch * a.hkv * a.qblocks;
  const auto body = [&] {
#pragma omp for schedule(static)
    for (std::int64_t item = 0; item < pack_items; ++item) {  // (b, j, packed tile)
      const auto [t, j, b] = kernels::Unravel(item, packed, a.hkv);
      const std::int64_t u0 = (tile0 + t) * kTile, n = std::min(kTile, L - u0);
      // The K tile the kernels read for keys u0.. (through the block table); its V tile follows.
      std::byte* const tile = kv + a.tile_offset(b, j, u0) * esize;
      if (esize == 4) {
        auto* e = reinterpret_cast<std::uint32_t*>(tile);
        pack_tile(args.k, args.v, b, j, u0, n, a.dh, e,
                  v_in_place ? nullptr : e + a.layout.tile_elems());
      } else {
        auto* e = reinterpret_cast<std::uint16_t*>(tile);
        pack_tile(args.k, args.v, b, j, u0, n, a.dh, e,
                  v_in_place ? nullptr : e + a.layout.tile_elems());
      }
    }
    kernel(a);  // shares out the units; its `omp for` ends with a barrier
    float* const acc = a.scratch.at(merge_slot, omp_get_thread_num());  // [d_h]
#pragma omp for schedule(static)
    for (std::int64_t grp = 0; grp < groups; ++grp) merge_decode_group(a, grp, acc, act, out, lse);
  };
  if (team == 1 && omp_get_level() == 0) {  // no region to open (kernel_skeleton.hpp)
    body();
  } else {
#pragma omp parallel num_threads(team)
    body();
  }
}

}  // namespace tokenmix::detail
