// The AMX body of the chunked-prefill attention kernel (prefill_attention.h calls it for bf16 where the compiler
// targets AMX-BF16 and the OS grants the tile state; the notes: layers/attention/cpu_prefill.py). Blocks of 16 query
// rows: Q @ K^T as tile products into a whole row of fp32 scores, the softmax of prefill_bf16.h, then P @ V as tile
// products over the same packed K and V as the AVX512-BF16 body.
#pragma once
#include "prefill_bf16.h"
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cstring>
#include <vector>
// the body is built where the compiler targets AMX-BF16 (and so AVX512-BF16): -march=native on an AMX CPU with a
// compiler that knows AMX (GCC 11+); elsewhere bf16 runs the AVX512-BF16 body or SDPA
#if defined(__AVX512BF16__) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define ORTHRUS_PREFILL_AMX 1
#else
#define ORTHRUS_PREFILL_AMX 0
#endif

#if ORTHRUS_PREFILL_AMX
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace prefill_amx {
constexpr int64_t RB = 16;  // query rows per block: a tile's rows
constexpr int64_t KB = 64;  // keys per score block: four tiles of 16 keys

// Linux grants a process AMX's tile state only on request (arch_prctl, asm/prctl.h's values); oneDNN asks too when
// it first runs on AMX. Without the grant the first tile instruction kills the process, so the body runs only after
// it was given.
inline bool usable() {
  static const bool granted = [] {
    constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return granted;
}

// Every tile 16 rows of 64 bytes: 16 x 32 bf16 operands, 16 x 16 fp32 accumulators. Tiles 0-2 hold operands, 4-7
// accumulators. Loaded per thread (the tile state is a thread's), released at the end of its work.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// The thread's tiles configured as above for its lifetime, released after (also when the work throws). Other AMX
// code on the thread (oneDNN's, torch's brgemm) configures its own tiles before each use and releases them after.
struct TileScope {
  TileScope() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) cfg.colsb[t] = 64, cfg.rows[t] = 16;
    _tile_loadconfig(&cfg);
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// K and V of each (sequence, KV head) as whole tiles, each one contiguous KiB: K as [Lp/16][D/32] tiles of
// (16 pairs of dims) x (16 keys), V as [Lp/32][D/16] tiles of (16 pairs of keys) x (16 dims): the pairs of
// pack_kv's layout, in the order the tile loads read them (a strided tile of a long sequence spans 16 pages).
// Keys past a sequence's last are zeros.
inline prefill_bf16::PackedKV pack_tiles(const prefill_bf16::Operands& o) {
  using namespace prefill_bf16;
  PackedKV p = packed_room(o, KB);
  const int64_t D = o.D, P = D / 2;
  // pairs of bf16 lanes: lo[2i] = a[i], lo[2i + 1] = b[i] for i < 16; hi the same for i in 16 .. 32
  alignas(64) int16_t lo_idx[32], hi_idx[32];
  for (int i = 0; i < 16; ++i) {
    lo_idx[2 * i] = static_cast<int16_t>(i), lo_idx[2 * i + 1] = static_cast<int16_t>(32 + i);
    hi_idx[2 * i] = static_cast<int16_t>(16 + i), hi_idx[2 * i + 1] = static_cast<int16_t>(48 + i);
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  // lane j: the offset of key j's first pair in a block of 16 gathered keys
  const __m512i rows16 = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(static_cast<int>(P)));
  at::parallel_for(0, o.S * o.KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> krows(16 * P);  // a block's 16 keys, gathered from their slots
    std::vector<uint16_t> zero(D, 0);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t s = item / o.KVH, h = item % o.KVH, L = o.cl[s] + o.ql[s], Lp = p.layout.padded[s];
      uint32_t* kd = const_cast<uint32_t*>(p.keys(s, h, D));
      uint32_t* vd = const_cast<uint32_t*>(p.values(s, h, D));
      auto row = [&](const uint16_t* cache, int64_t j) {
        return j < L ? cache + (key_slot(o, s, j) * o.KVH + h) * D : zero.data();
      };
      for (int64_t j0 = 0; j0 < Lp; j0 += 16) {
        for (int64_t j = 0; j < 16; ++j) std::memcpy(krows.data() + j * P, row(o.kp, j0 + j), D * sizeof(uint16_t));
        uint32_t* kt = kd + (j0 / 16) * (P / 16) * 256;
        for (int64_t q = 0; q < P; ++q)  // tile q / 16, its row q % 16: pair q of the 16 keys
          _mm512_storeu_si512(kt + (q / 16) * 256 + (q % 16) * 16,
                              _mm512_i32gather_epi32(_mm512_add_epi32(rows16, _mm512_set1_epi32(static_cast<int>(q))),
                                                     krows.data(), 4));
      }
      for (int64_t j = 0; j < Lp; j += 2) {
        const uint16_t *a = row(o.vp, j), *b = row(o.vp, j + 1);
        uint32_t* vt = vd + (j / 32) * (D / 16) * 256 + ((j % 32) / 2) * 16;  // row j / 2 of its tiles
        for (int64_t d = 0; d < D; d += 32) {
          const __m512i va = _mm512_loadu_si512(a + d), vb = _mm512_loadu_si512(b + d);
          _mm512_storeu_si512(vt + (d / 16) * 256, _mm512_permutex2var_epi16(va, lo, vb));
          _mm512_storeu_si512(vt + (d / 16 + 1) * 256, _mm512_permutex2var_epi16(va, hi, vb));
        }
      }
    }
  });
  return p;
}

// scores[16][jb .. jb + 64) (row stride ld floats) = Q[16, D] K[jb .. jb + 64, D]^T; K in tiles (pack_tiles)
inline void scores_block(const uint16_t* qbuf, const uint32_t* kd, int64_t D, int64_t jb, float* out, int64_t ld) {
  _tile_zero(4);
  _tile_zero(5);
  _tile_zero(6);
  _tile_zero(7);
  for (int64_t kk = 0; kk < D / 32; ++kk) {
    const uint32_t* kb = kd + ((jb / 16) * (D / 32) + kk) * 256;  // the tile of keys jb .. jb + 16, dims 32 kk ..
    const int64_t next = (D / 32) * 256;                             // the next 16 keys' tile
    _tile_loadd(0, qbuf + 32 * kk, D * 2);
    _tile_loadd(1, kb, 64);
    _tile_dpbf16ps(4, 0, 1);
    _tile_loadd(2, kb + next, 64);
    _tile_dpbf16ps(5, 0, 2);
    _tile_loadd(1, kb + 2 * next, 64);
    _tile_dpbf16ps(6, 0, 1);
    _tile_loadd(2, kb + 3 * next, 64);
    _tile_dpbf16ps(7, 0, 2);
  }
  _tile_stored(4, out + jb, ld * 4);
  _tile_stored(5, out + jb + 16, ld * 4);
  _tile_stored(6, out + jb + 32, ld * 4);
  _tile_stored(7, out + jb + 48, ld * 4);
}

// out[16][NT * 16] = P[16, jlo .. jhi) V[jlo .. jhi, dc .. dc + NT * 16); P bf16 rows of ld, V in tiles (pack_tiles)
template <int NT>
inline void values_block(const uint16_t* pbuf, int64_t ld, const uint32_t* vd, int64_t D, int64_t jlo, int64_t jhi,
                         int64_t dc, float* out) {
  _tile_zero(4);
  _tile_zero(5);
  if (NT == 4) {
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t jk = jlo; jk < jhi; jk += 32) {
    const uint32_t* vb = vd + ((jk / 32) * (D / 16) + dc / 16) * 256;  // keys jk .. jk + 32, dims dc .. dc + 16
    _tile_loadd(0, pbuf + jk, ld * 2);
    _tile_loadd(1, vb, 64);
    _tile_dpbf16ps(4, 0, 1);
    _tile_loadd(2, vb + 256, 64);
    _tile_dpbf16ps(5, 0, 2);
    if (NT == 4) {
      _tile_loadd(1, vb + 512, 64);
      _tile_dpbf16ps(6, 0, 1);
      _tile_loadd(2, vb + 768, 64);
      _tile_dpbf16ps(7, 0, 2);
    }
  }
  _tile_stored(4, out, NT * 64);
  _tile_stored(5, out + 16, NT * 64);
  if (NT == 4) {
    _tile_stored(6, out + 32, NT * 64);
    _tile_stored(7, out + 48, NT * 64);
  }
}

void attend_rows(const prefill_bf16::Operands& o, double scale) {
  using namespace prefill_bf16;
  const int64_t D = o.D;
  const PackedKV packed = pack_tiles(o);
  const int64_t Lmax = packed.layout.max_padded;
  const std::vector<int64_t> order = work_items(o, RB);
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, static_cast<int64_t>(order.size()), 1, [&](int64_t begin, int64_t end) {
    const TileScope tiles;
    std::vector<float> sbuf(RB * Lmax);
    std::vector<uint16_t> pbuf(RB * Lmax), qbuf(RB * D);
    float obuf[RB * 64];
    for (int64_t it = begin; it < end; ++it) {
      const Block<RB, KB> b(o, packed, order[it]);
      for (int64_t r = 0; r < RB; ++r) std::memcpy(qbuf.data() + r * D, b.qrow[r], D * sizeof(uint16_t));
      const uint32_t* kd = packed.keys(b.s, b.h, D);
      for (int64_t jb = b.jlo; jb < b.jhi; jb += KB) scores_block(qbuf.data(), kd, D, jb, sbuf.data(), Lmax);
      float inv[RB];
      b.softmax(sbuf.data(), pbuf.data(), Lmax, sc, inv);
      const uint32_t* vd = packed.values(b.s, b.h, D);
      const int nt = D % 64 == 0 ? 4 : 2;
      for (int64_t dc = 0; dc < D; dc += nt * 16) {
        if (nt == 4) values_block<4>(pbuf.data(), Lmax, vd, D, b.jlo, b.jhi, dc, obuf);
        else values_block<2>(pbuf.data(), Lmax, vd, D, b.jlo, b.jhi, dc, obuf);
        b.write(o, dc, obuf, nt, inv);
      }
    }
  });
}

}  // namespace prefill_amx
#endif

// Whether the bf16 body on AMX tiles runs here: built for AMX-BF16 and granted the tile state.
inline bool prefill_attention_amx_runs() {
#if ORTHRUS_PREFILL_AMX
  return prefill_amx::usable();
#else
  return false;
#endif
}
