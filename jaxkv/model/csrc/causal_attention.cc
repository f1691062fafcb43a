// Causal self-attention of a prompt (prefill), flash-style: an XLA FFI target for the CPU
// (jaxkv/model/cache_kernel.py builds, loads and calls it).
//
// XLA computes prefill attention block by block (jaxkv.model.layers.causal_block_attention):
// each block of 256 queries writes its scores against every key it may see to memory, then
// reads them back for the maximum, the exponentials, the sum and the weighted values, and the
// keys right of the diagonal inside a block are computed and masked away. Here a group of
// kRows consecutive query positions of one query head walks the keys it may see in blocks of
// kKeys, keeping its scores in vector registers (the keys on the lanes, read from a
// transposed copy), its running maximum, exp-sum and output in L1 (an online softmax: the
// output is rescaled only when the maximum grows), so nothing of size T^2 touches memory and
// only the blocks that touch the diagonal are masked. Groups are work items on XLA's
// intra-op thread pool, the longest first.
//
// Contract (layers.causal_block_attention's): slot t of the prompt holds position t, or -1
// (padding); a key is visible to a query when both positions are >= 0, the key's is not
// greater, and (with a sliding window w) greater than the query's minus w. A query that sees
// no key gets an all-zero output, as XLA's masked softmax gives it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxkv_simd;

#if defined(__AVX512F__)
constexpr int kRows = 12;  // query rows per chunk: 2 * kRows score vectors in registers
constexpr int kPvRows = 4;  // rows per pass of the value update (kPvRows * 4 accumulators)
#else
constexpr int kRows = 4;
constexpr int kPvRows = 2;
#endif
constexpr int kKeys = 2 * kLanes;  // keys per block: two vectors of scores per row
constexpr int kGroupRows = 2 * kRows;  // rows (positions x query heads) per work item
constexpr int kPvVecs = 4;         // head-dimension vectors per pass of the value update
constexpr int kMaxHead = 256;
constexpr float kNegInf = -1e30f;

inline vf splat(float x) { return vf{} + x; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }
inline float hmax(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)v);
#elif defined(__AVX2__)
  __m128 m = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
#else
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = std::max(m, v[i]);
  return m;
#endif
}

struct Shape {
  int64_t B, K, G, T, H, Tp;  // Tp: T rounded up to kKeys (the transposed keys' row length)
  int64_t P;                  // query positions per work item (all G heads of each)
  int64_t window;             // 0: none
  float scale;
};

// Lanes whose key position kp a query at position qp >= 0 may see.
inline vi visible(vi kp, int32_t qp, int64_t window) {
  vi see = (kp >= 0) & (kp <= qp);
  if (window > 0) see &= kp > static_cast<int32_t>(qp - window);
  return see;
}

// Keys of (b, k) [T, H] into kt [Tp / kKeys, H, kKeys], zero-padded: each block's keys on
// the lanes, the block contiguous (a plain [H, Tp] transpose puts a block's rows Tp floats
// apart, all in one L1 set).
void Transpose(const float* k, float* kt, const Shape& s) {
  std::fill(kt, kt + s.Tp * s.H, 0.0f);
  for (int64_t j = 0; j < s.T; ++j) {
    float* block = kt + (j / kKeys) * s.H * kKeys + j % kKeys;
    for (int64_t h = 0; h < s.H; ++h) block[h * kKeys] = k[j * s.H + h];
  }
}

// Scores of kRows query rows (q [H, kRows], scaled) against a block of kKeys keys (kt
// [H, kKeys]) into s [kRows, kKeys], kept in registers until stored.
inline void Scores(const float* __restrict q, const float* __restrict kt, int64_t H,
                   float* __restrict s) {
  vf acc[kRows][2] = {};
  for (int64_t h = 0; h < H; ++h) {
    const vf k0 = load(kt + h * kKeys), k1 = load(kt + h * kKeys + kLanes);
#pragma GCC unroll 16
    for (int r = 0; r < kRows; ++r) {
      acc[r][0] += q[h * kRows + r] * k0;
      acc[r][1] += q[h * kRows + r] * k1;
    }
  }
  for (int r = 0; r < kRows; ++r) {
    store(s + r * kKeys, acc[r][0]);
    store(s + r * kKeys + kLanes, acc[r][1]);
  }
}

// Rows [r0, r0 + kPvRows) of acc [kRows, H] += p [kRows, kKeys] (their first n keys) @ v.
inline void AddValues(float* __restrict acc, const float* __restrict p, const float* v, int n,
                      int64_t r0, int64_t H) {
  for (int64_t h0 = 0; h0 < H; h0 += kPvVecs * kLanes) {
    vf a[kPvRows][kPvVecs];
    for (int r = 0; r < kPvRows; ++r)
      for (int c = 0; c < kPvVecs; ++c) a[r][c] = load(acc + (r0 + r) * H + h0 + c * kLanes);
    for (int j = 0; j < n; ++j) {
      vf vv[kPvVecs];
      for (int c = 0; c < kPvVecs; ++c) vv[c] = load(v + j * H + h0 + c * kLanes);
      for (int r = 0; r < kPvRows; ++r) {
        const float w = p[(r0 + r) * kKeys + j];
        for (int c = 0; c < kPvVecs; ++c) a[r][c] += w * vv[c];
      }
    }
    for (int r = 0; r < kPvRows; ++r)
      for (int c = 0; c < kPvVecs; ++c) store(acc + (r0 + r) * H + h0 + c * kLanes, a[r][c]);
  }
}

// Query positions [t0, t0 + s.P) of every query head of KV head (b, k) (q [G, T, H] and o
// [G, T, H] of that KV head): G * P rows, row i * G + g for position t0 + i and head g, in
// chunks of kRows (the last padded with rows that see nothing). Every chunk's scores come
// from the same block of keys while it is in L1, and the group's rows share one key range.
void Group(const float* q, const float* kt, const float* v, const int32_t* pos, float* o,
           int64_t t0, const Shape& s) {
  const int64_t H = s.H, G = s.G, rows = G * s.P;
  const int64_t padded = (rows + kRows - 1) / kRows * kRows;
  std::vector<float> qs(padded * H, 0.0f), acc(padded * H, 0.0f), p(padded * kKeys);
  std::vector<float> m(padded, kNegInf);
  std::vector<vf> l(padded, vf{});
  std::vector<int32_t> qp(padded, -1);
  int32_t lo_pos = INT32_MAX, hi_pos = -1;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / G, g = r % G;
    if (t >= s.T) continue;
    qp[r] = pos[t];
    float* chunk = qs.data() + (r / kRows) * H * kRows + r % kRows;  // [H, kRows] per chunk
    for (int64_t h = 0; h < H; ++h) chunk[h * kRows] = q[(g * s.T + t) * H + h] * s.scale;
    if (qp[r] >= 0) lo_pos = std::min(lo_pos, qp[r]), hi_pos = std::max(hi_pos, qp[r]);
  }
  const int64_t hi = std::min<int64_t>(s.T, int64_t{hi_pos} + 1);  // keys [lo, hi) at most
  int64_t lo = 0;
  if (s.window > 0 && hi_pos >= 0) lo = std::max<int64_t>(0, lo_pos - s.window + 1);
  for (int64_t j0 = lo - lo % kKeys; j0 < hi; j0 += kKeys) {
    for (int64_t c = 0; c < padded; c += kRows)  // p: the block's scores, then exponentials
      Scores(qs.data() + c * H, kt + j0 * H, H, p.data() + c * kKeys);
    const int nk = static_cast<int>(std::min<int64_t>(kKeys, s.T - j0));
    const bool edge = j0 + kKeys - 1 > lo_pos || nk < kKeys ||
                      (s.window > 0 && j0 <= hi_pos - s.window);
    vi kp[2];
    if (edge) {
      alignas(64) int32_t kb[kKeys];
      for (int c = 0; c < kKeys; ++c) kb[c] = c < nk ? pos[j0 + c] : -1;
      std::memcpy(kp, kb, sizeof(kp));
    }
    for (int64_t r = 0; r < padded; ++r) {
      float* pr = p.data() + r * kKeys;
      if (qp[r] < 0) {  // padding (or past the prompt's end): sees nothing
        std::fill(pr, pr + kKeys, 0.0f);
        continue;
      }
      vf sc[2] = {load(pr), load(pr + kLanes)};
      if (edge) {
        for (int c = 0; c < 2; ++c) sc[c] = visible(kp[c], qp[r], s.window) ? sc[c] : splat(kNegInf);
      }
      const float top = hmax(vmax(sc[0], sc[1]));
      if (top <= kNegInf) {  // this row sees no key of the block
        std::fill(pr, pr + kKeys, 0.0f);
        continue;
      }
      if (top > m[r]) {
        const float alpha = std::exp(m[r] - top);  // 0 while nothing was seen
        for (int64_t h = 0; h < H; ++h) acc[r * H + h] *= alpha;
        l[r] *= alpha;
        m[r] = top;
      }
      const vf e0 = exp_nonpositive(sc[0] - m[r]), e1 = exp_nonpositive(sc[1] - m[r]);
      l[r] += e0 + e1;
      store(pr, e0);
      store(pr + kLanes, e1);
    }
    for (int64_t r0 = 0; r0 < padded; r0 += kPvRows)
      AddValues(acc.data(), p.data(), v + j0 * H, nk, r0, H);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = t0 + r / G, g = r % G;
    if (t >= s.T) continue;
    const float inv = 1.0f / std::max(hsum(l[r]), 1e-30f);
    for (int64_t h = 0; h < H; ++h) o[(g * s.T + t) * H + h] = acc[r * H + h] * inv;
  }
}

ffi::Error CausalAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> pos,
                           ffi::ResultBuffer<ffi::F32> o, int64_t window, float scale) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), pd = pos.dimensions();
  if (qd.size() != 5 || kd.size() != 4 || vd.size() != 4 || pd.size() != 2)
    return ffi::Error::InvalidArgument("causal_attention: q [B,K,G,T,H], k, v [B,K,T,H], pos [B,T]");
  Shape s{qd[0], qd[1], qd[2], qd[3], qd[4], 0, 0, window, scale};
  s.Tp = (s.T + kKeys - 1) / kKeys * kKeys;
  s.P = std::max<int64_t>(1, kGroupRows / s.G);
  for (int i = 0; i < 4; ++i) {
    const int64_t want = i == 2 ? s.T : (i == 3 ? s.H : qd[i]);
    if (kd[i] != want || vd[i] != want)
      return ffi::Error::InvalidArgument("causal_attention: k and v must be [B, K, T, H]");
  }
  if (pd[0] != s.B || pd[1] != s.T)
    return ffi::Error::InvalidArgument("causal_attention: pos must be [B, T]");
  if (s.H % (kPvVecs * kLanes) != 0 || s.H > kMaxHead)
    return ffi::Error::InvalidArgument("causal_attention: the head dimension must be a multiple of 64, at most 256");
  const int64_t BK = s.B * s.K;
  std::vector<float> kt(static_cast<size_t>(BK * s.H * s.Tp));
  const float *qp = q.typed_data(), *kp = k.typed_data(), *vp = v.typed_data();
  const int32_t* pp = pos.typed_data();
  float* op = o->typed_data();
  ParallelFor(pool, BK, [&](int64_t bk) {
    Transpose(kp + bk * s.T * s.H, kt.data() + bk * s.H * s.Tp, s);
  });
  // Items: (b, k, group), each KV head's groups together (its transposed keys and values,
  // 2 * T * H floats, stay in the cores' L2 while they work on it), the groups of the latest
  // positions (the most keys) first.
  const int64_t groups = (s.T + s.P - 1) / s.P;
  ParallelFor(pool, groups * BK, [&](int64_t item) {
    const int64_t t0 = (groups - 1 - item % groups) * s.P, bk = item / groups, b = bk / s.K;
    const int64_t head = bk * s.G * s.T * s.H;
    Group(qp + head, kt.data() + bk * s.H * s.Tp, vp + bk * s.T * s.H, pp + b * s.T, op + head,
          t0, s);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvCausalAttentionF32, CausalAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale"));
