// Decode-time attention over one layer of a stacked KV cache, in one pass over the keys
// and values (an XLA FFI target for the CPU; jaxkv/model/cache_kernel.py builds, loads and
// calls it).
//
// For every sequence b and KV head k, the R = G * T query rows of that head read each cached
// key once (all R dot products per key), take a softmax over the slots they may see (causal,
// non-empty, inside the sliding window; positions decide, never slot indices) and weight the
// values, which are read once too. The slots are cut into chunks; each chunk gives its rows'
// maximum score m, their sum of exp(s - m) l and their unnormalized output, and the chunks
// of a (b, k) pair are merged at the end (split-K "flash decoding"). Chunks run on XLA's
// intra-op thread pool.
//
// Returned per row: the normalized output over the cache o [B, K, R, H], m and l [B, K, R],
// from which the caller merges in the new tokens' own keys and values, and (the ``Probs``
// targets, for the attention statistics) the probabilities of the slots [B, K, R, C],
// normalized over the cache. A row that sees no slot gets m = -1e30, l = 0 and o = 0.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxkv_simd;

constexpr float kNegInf = -1e30f;
constexpr int64_t kChunk = 512;  // slots per work item (128 KB of float32 keys at H = 64)
// From this many (b, k) pairs, a decode step with statistics gives each pair one work item.
constexpr int64_t kFusedPairs = 8;

template <typename T>
inline float widen(T x) {
  return static_cast<float>(x);
}

template <>
inline float widen<int8_t>(int8_t x) {
  return static_cast<float>(x);
}

template <>
inline float widen<uint16_t>(uint16_t x) {
  _Float16 h;
  std::memcpy(&h, &x, sizeof(h));
  return static_cast<float>(h);
}

struct Shape {
  int64_t B, K, R, H, C, T, layer;
  int64_t window;  // 0: none
  float scale;
};

// A row's scores over n slots (kNegInf: not visible) become exp(score - top) in place (0 for
// a hidden slot, all 0 when none is visible), copied to ``probs`` (unless null); returns
// their sum. With ``moment`` (unless null), also sum e * (score - top) there, from which the
// row's entropy follows once every chunk is merged (``Attend``).
inline float exponentiate(float* __restrict sr, int64_t n, float top, float* __restrict probs,
                          float* __restrict moment) {
  float sum = 0.0f, mo = 0.0f;
  if (top > kNegInf && moment != nullptr) {
#pragma omp simd reduction(+ : sum, mo)
    for (int64_t c = 0; c < n; ++c) {
      const bool seen = sr[c] > kNegInf;
      const float d = seen ? sr[c] - top : 0.0f;
      const float e = seen ? exp_nonpositive(d) : 0.0f;
      sr[c] = e;
      sum += e;
      mo += e * d;
    }
  } else if (top > kNegInf) {
#pragma omp simd reduction(+ : sum)
    for (int64_t c = 0; c < n; ++c) {
      const float e = sr[c] > kNegInf ? exp_nonpositive(sr[c] - top) : 0.0f;
      sr[c] = e;
      sum += e;
    }
  } else {
    std::fill(sr, sr + n, 0.0f);
  }
  if (probs != nullptr) std::memcpy(probs, sr, n * sizeof(float));
  if (moment != nullptr) *moment = mo;
  return sum;
}

// A cached row as float32: the stored row itself, or widened into ``buf``.
inline const float* as_float(const float* row, int64_t, float*) { return row; }

inline const float* as_float(const int8_t* row, int64_t H, float* __restrict buf) {
  for (int64_t h = 0; h < H; ++h) buf[h] = widen(row[h]);
  return buf;
}

inline const float* as_float(const uint16_t* row, int64_t H, float* __restrict buf) {
  for (int64_t h = 0; h < H; ++h) buf[h] = widen(row[h]);
  return buf;
}

// One chunk [c0, c1) of (b, k): scores of the R rows, their maximum, exp sums and
// unnormalized outputs into m[R], l[R], acc[R * H]; with ``probs`` (the (b, k) block of the
// [R, C] probabilities, or null) the exponentials of the chunk's slots, which the merge
// scales. ``ks`` and ``vs`` are an int8 cache's per-slot key and value scales of (b, k) (null
// for a float cache): a slot's key scale multiplies its scores, its value scale its
// probabilities' weight on its value.
template <typename KV>
void chunk_attention(const Shape& s, const float* __restrict q, const int32_t* __restrict qpos,
                     const KV* __restrict keys, const KV* __restrict values,
                     const int32_t* __restrict kpos, int64_t c0, int64_t c1, float* __restrict m,
                     float* __restrict l, float* __restrict moment, float* __restrict acc,
                     float* __restrict probs, const float* __restrict ks,
                     const float* __restrict vs) {
  const int64_t R = s.R, H = s.H, n = c1 - c0;
  std::vector<float> score_buf(R * n), row_buf(H);
  float* __restrict scores = score_buf.data();
  float* __restrict buf = row_buf.data();
  for (int64_t c = 0; c < n; ++c) {
    const float* __restrict kc = as_float(keys + (c0 + c) * H, H, buf);
    const int32_t p = kpos[c0 + c];
    for (int64_t r = 0; r < R; ++r) {
      const int32_t qp = qpos[r];
      const bool ok = p >= 0 && qp >= 0 && p <= qp && (s.window == 0 || p > qp - s.window);
      const float* __restrict qr = q + r * H;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t h = 0; h < H; ++h) dot += qr[h] * kc[h];
      scores[r * n + c] = ok ? dot * s.scale * (ks ? ks[c0 + c] : 1.0f) : kNegInf;
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    float* __restrict sr = scores + r * n;
    float top = kNegInf;
#pragma omp simd reduction(max : top)
    for (int64_t c = 0; c < n; ++c) top = std::max(top, sr[c]);
    m[r] = top;
    l[r] = exponentiate(sr, n, top, probs == nullptr ? nullptr : probs + r * s.C + c0,
                       moment == nullptr ? nullptr : moment + r);
  }
  std::fill(acc, acc + R * H, 0.0f);
  for (int64_t c = 0; c < n; ++c) {
    const float* __restrict vc = as_float(values + (c0 + c) * H, H, buf);
    const float v_scale = vs ? vs[c0 + c] : 1.0f;
    for (int64_t r = 0; r < R; ++r) {
      const float p = scores[r * n + c] * v_scale;
      float* __restrict ar = acc + r * H;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) ar[h] += p * vc[h];
    }
  }
}

// The same with the row count and head size known at compile time, on the CPU's widest
// float vectors (GCC vector extensions: 16 lanes with AVX-512, else 8): the dot products of 4
// slots are reduced together (a transposing sum) instead of one horizontal sum each. With
// AVX-512's 32 registers the R rows' queries and outputs (R * H / 16 vectors each) stay in
// registers; with AVX2's 16 they would spill, so there the queries are read from L1 for every
// slot and the outputs are accumulated one vector of the head at a time.
#if defined(__AVX512F__)
constexpr bool kWideRegisters = true;
#else
constexpr bool kWideRegisters = false;
#endif

// The four sums of a, b, c, d (lanes 0-3 of the result hold them; the rest is junk).
#if defined(__AVX512F__)
inline vf sum4(vf a, vf b, vf c, vf d) {
  vf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
          __builtin_shufflevector(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                  30, 31);
  vf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
          __builtin_shufflevector(c, d, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29,
                                  30, 31);
  // lanes: a 0-7, b 8-15 | c 0-7, d 8-15 -> a 0-3, b 4-7, c 8-11, d 12-15
  vf x = __builtin_shufflevector(ab, cd, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26,
                                 27) +
         __builtin_shufflevector(ab, cd, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30,
                                 31);
  vf y = __builtin_shufflevector(x, x, 0, 1, 4, 5, 8, 9, 12, 13, 0, 1, 4, 5, 8, 9, 12, 13) +
         __builtin_shufflevector(x, x, 2, 3, 6, 7, 10, 11, 14, 15, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(y, y, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6, 0, 2, 4, 6) +
         __builtin_shufflevector(y, y, 1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7, 1, 3, 5, 7);
}
#else
inline vf sum4(vf a, vf b, vf c, vf d) {
  // halves added: a 0-3, b 4-7 | c 0-3, d 4-7
  vf ab = __builtin_shufflevector(a, b, 0, 1, 2, 3, 8, 9, 10, 11) +
          __builtin_shufflevector(a, b, 4, 5, 6, 7, 12, 13, 14, 15);
  vf cd = __builtin_shufflevector(c, d, 0, 1, 2, 3, 8, 9, 10, 11) +
          __builtin_shufflevector(c, d, 4, 5, 6, 7, 12, 13, 14, 15);
  // -> a 0-1, b 2-3, c 4-5, d 6-7
  vf x = __builtin_shufflevector(ab, cd, 0, 1, 4, 5, 8, 9, 12, 13) +
         __builtin_shufflevector(ab, cd, 2, 3, 6, 7, 10, 11, 14, 15);
  return __builtin_shufflevector(x, x, 0, 2, 4, 6, 0, 2, 4, 6) +
         __builtin_shufflevector(x, x, 1, 3, 5, 7, 1, 3, 5, 7);
}
#endif

template <typename KV, int kR, int kH>
void chunk_fixed(const Shape& s, const float* __restrict q, const int32_t* __restrict qpos,
                 const KV* __restrict keys, const KV* __restrict values,
                 const int32_t* __restrict kpos, int64_t c0, int64_t c1, float* __restrict m,
                 float* __restrict l, float* __restrict moment, float* __restrict acc,
                 float* __restrict probs, const float* __restrict ks,
                 const float* __restrict vs) {
  constexpr int kV = kH / kLanes;
  const int64_t n = c1 - c0;
  std::vector<float> score_buf(kR * n);
  float* __restrict scores = score_buf.data();
  vf qv[kWideRegisters ? kR : 1][kWideRegisters ? kV : 1];
  if constexpr (kWideRegisters) {
    for (int r = 0; r < kR; ++r)
      for (int j = 0; j < kV; ++j) qv[r][j] = load(q + r * kH + kLanes * j);
  }
  auto query = [&](int r, int j) {
    if constexpr (kWideRegisters) return qv[r][j];
    return load(q + r * kH + kLanes * j);
  };
  int64_t c = 0;
  for (; c + 4 <= n; c += 4) {
    const KV* k0 = keys + (c0 + c) * kH;
    const KV* k1 = k0 + kH;
    const KV* k2 = k1 + kH;
    const KV* k3 = k2 + kH;
    prefetch_ahead(k0, 4 * kH * sizeof(KV));
    for (int r = 0; r < kR; ++r) {
      vf q0 = query(r, 0);
      vf a = q0 * load(k0), b = q0 * load(k1);
      vf cc = q0 * load(k2), d = q0 * load(k3);
      for (int j = 1; j < kV; ++j) {
        const vf qj = query(r, j);
        a += qj * load(k0 + kLanes * j);
        b += qj * load(k1 + kLanes * j);
        cc += qj * load(k2 + kLanes * j);
        d += qj * load(k3 + kLanes * j);
      }
      vf t = sum4(a, b, cc, d);
      for (int u = 0; u < 4; ++u) scores[r * n + c + u] = t[u];
    }
  }
  for (; c < n; ++c) {
    const KV* kc = keys + (c0 + c) * kH;
    for (int r = 0; r < kR; ++r) {
      vf a = query(r, 0) * load(kc);
      for (int j = 1; j < kV; ++j) a += query(r, j) * load(kc + kLanes * j);
      float dot = 0.0f;
      for (int u = 0; u < kLanes; ++u) dot += a[u];
      scores[r * n + c] = dot;
    }
  }
  for (int r = 0; r < kR; ++r) {
    float* __restrict sr = scores + r * n;
    const int32_t qp = qpos[r];
    float top = kNegInf;
#pragma omp simd reduction(max : top)
    for (int64_t c = 0; c < n; ++c) {
      const int32_t p = kpos[c0 + c];
      const bool ok = p >= 0 && qp >= 0 && p <= qp && (s.window == 0 || p > qp - s.window);
      sr[c] = ok ? sr[c] * s.scale * (ks ? ks[c0 + c] : 1.0f) : kNegInf;
      top = std::max(top, sr[c]);
    }
    m[r] = top;
    l[r] = exponentiate(sr, n, top, probs == nullptr ? nullptr : probs + r * s.C + c0,
                       moment == nullptr ? nullptr : moment + r);
  }
  if constexpr (kWideRegisters) {
    vf av[kR][kV] = {};
    for (int64_t c = 0; c < n; ++c) {
      const KV* vc = values + (c0 + c) * kH;
      prefetch_ahead(vc, kH * sizeof(KV));
      vf vv[kV];
      for (int j = 0; j < kV; ++j) vv[j] = load(vc + kLanes * j);
      const float v_scale = vs ? vs[c0 + c] : 1.0f;
      for (int r = 0; r < kR; ++r) {
        const float p = scores[r * n + c] * v_scale;
        for (int j = 0; j < kV; ++j) av[r][j] += p * vv[j];
      }
    }
    for (int r = 0; r < kR; ++r)
      for (int j = 0; j < kV; ++j) std::memcpy(acc + r * kH + kLanes * j, &av[r][j], sizeof(vf));
  } else {
    if (vs) {  // an int8 cache: the value scales folded into the probabilities' weights
      for (int r = 0; r < kR; ++r)
        for (int64_t c = 0; c < n; ++c) scores[r * n + c] *= vs[c0 + c];
    }
    for (int j = 0; j < kV; ++j) {
      vf av[kR] = {};
      for (int64_t c = 0; c < n; ++c) {
        if (j == 0) prefetch_ahead(values + (c0 + c) * kH, kH * sizeof(KV));
        const vf vv = load(values + (c0 + c) * kH + kLanes * j);
        for (int r = 0; r < kR; ++r) av[r] += scores[r * n + c] * vv;
      }
      for (int r = 0; r < kR; ++r) std::memcpy(acc + r * kH + kLanes * j, &av[r], sizeof(vf));
    }
  }
}

template <typename KV>
using ChunkFn = void (*)(const Shape&, const float*, const int32_t*, const KV*, const KV*,
                         const int32_t*, int64_t, int64_t, float*, float*, float*, float*,
                         float*, const float*, const float*);

template <typename KV, int kH>
ChunkFn<KV> pick_rows(int64_t R) {
  switch (R) {
    case 1: return chunk_fixed<KV, 1, kH>;
    case 2: return chunk_fixed<KV, 2, kH>;
    case 3: return chunk_fixed<KV, 3, kH>;
    case 4: return chunk_fixed<KV, 4, kH>;
    default: return chunk_attention<KV>;
  }
}

// The fixed-size kernel for the common shapes (H = 64 or 128, at most 4 rows), else the
// general one.
template <typename KV>
ChunkFn<KV> pick(const Shape& s) {
  if (s.H == 64) return pick_rows<KV, 64>(s.R);
  if (s.H == 128) return pick_rows<KV, 128>(s.R);
  return chunk_attention<KV>;
}

// The attention statistics of a decode step, updated in place (the ``Stats`` targets): each
// is the stacked [L, B, K, C] array of one statistic (null: not carried), layer ``layer``'s
// slice rewritten from the probabilities of the step's one query per row (T = 1), normalized
// over the cache and the new token, whose key ``k_new`` [B, K, H] the kernel scores itself.
// As ``jaxkv.stats`` defines them (a mean over the G query heads of a KV head; padding
// queries contribute nothing): attn and attn_sq are replaced, attn_cum adds up, recent and
// recent_ent decay by ``lam`` first. ``entropy`` [B, K, R] receives each row's entropy over
// the cache and the new token (for the new token's own recent_ent).
enum Stat { kAttn, kAttnSq, kAttnCum, kRecent, kRecentEnt, kNumStats };

struct Stats {
  float* stat[kNumStats];
  const float* k_new;
  float* entropy;
  float lam;
};

// Layer s.layer's statistics of (b, k) = bk over slots [c0, c1), from the chunk's
// exponentials ``e`` (the (b, k) block of [R, C]) times each row's factor ``f`` [R] (its
// chunk's weight over the whole softmax), and the rows' entropies ``ent`` [R].
inline void update_stats(const Shape& s, const Stats& st, int64_t bk, int64_t c0, int64_t c1,
                         const float* __restrict e, const float* __restrict f,
                         const float* __restrict ent, bool valid) {
  const int64_t off = (s.layer * s.B * s.K + bk) * s.C + c0, n = c1 - c0;
  // The chunk's means over the rows (kChunk slots at most) of p, p^2 and p * entropy, each a
  // plain loop over the slots (vectorized), then each statistic its own loop.
  float a[kChunk], a2[kChunk], ae[kChunk];
  const float g = valid ? 1.0f / static_cast<float>(s.R) : 0.0f;
  const bool want_sq = st.stat[kAttnSq] != nullptr, want_ent = st.stat[kRecentEnt] != nullptr;
  std::fill(a, a + n, 0.0f);
  if (want_sq) std::fill(a2, a2 + n, 0.0f);
  if (want_ent) std::fill(ae, ae + n, 0.0f);
  for (int64_t r = 0; r < s.R; ++r) {
    const float* __restrict er = e + r * s.C + c0;
    const float fr = f[r], fe = f[r] * ent[r];
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) a[j] += er[j] * fr;
    if (want_sq)
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) a2[j] += (er[j] * fr) * (er[j] * fr);
    if (want_ent)
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) ae[j] += er[j] * fe;
  }
  const float lam = st.lam;
  if (float* __restrict x = st.stat[kAttn])
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) x[off + j] = a[j] * g;
  if (float* __restrict x = st.stat[kAttnSq])
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) x[off + j] = a2[j] * g;
  if (float* __restrict x = st.stat[kAttnCum])
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) x[off + j] += a[j] * g;
  if (float* __restrict x = st.stat[kRecent])
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) x[off + j] = lam * x[off + j] + a[j] * g;
  if (float* __restrict x = st.stat[kRecentEnt])
#pragma omp simd
    for (int64_t j = 0; j < n; ++j) x[off + j] = lam * x[off + j] + ae[j] * g;
}

// The whole call; ``probs`` (null: not wanted) receives each row's probabilities over the
// cache slots, normalized over the cache [B, K, R, C]; ``stats`` (null: none) are updated in
// place (``Stats``).
template <ffi::DataType KVType>
ffi::Error Attend(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::S32>& qpos,
                  ffi::Buffer<KVType>& keys, ffi::Buffer<KVType>& values,
                  ffi::Buffer<ffi::S32>& kpos, ffi::Buffer<ffi::S32>& layer, float* o, float* om,
                  float* ol, float* probs, const float* k_scale, const float* v_scale,
                  int64_t window, float scale, const Stats* stats = nullptr) {
  using KV = ffi::NativeType<KVType>;
  auto qd = q.dimensions();     // [B, K, R, H]
  auto pd = qpos.dimensions();  // [B, T]
  auto kd = keys.dimensions();  // [L, B, K, C, H]
  if (qd.size() != 4 || pd.size() != 2 || kd.size() != 5) {
    return ffi::Error::InvalidArgument("cache_attention: q [B,K,R,H], qpos [B,T], keys [L,B,K,C,H]");
  }
  Shape s{qd[0], qd[1], qd[2], qd[3], kd[3], pd[1], 0, window, scale};
  if (kd[1] != s.B || kd[2] != s.K || kd[4] != s.H || s.R % s.T != 0) {
    return ffi::Error::InvalidArgument("cache_attention: mismatched shapes");
  }
  if (stats != nullptr && s.T != 1) {
    return ffi::Error::InvalidArgument("cache_attention: statistics in place need one query");
  }
  s.layer = layer.typed_data()[0];
  if (s.layer < 0 || s.layer >= kd[0]) {
    return ffi::Error::InvalidArgument("cache_attention: layer out of range");
  }
  const int64_t n_chunks = (s.C + kChunk - 1) / kChunk;
  const int64_t n_items = s.B * s.K * n_chunks;
  // per item: R maxima, R sums, R moments, R * H outputs
  const int64_t per_item = s.R * (3 + s.H);
  std::vector<float> partial(n_items * per_item);
  // With statistics the exponentials go to a scratch copy of the probabilities' shape, kept
  // by the calling thread from call to call (a fresh allocation of this size is mapped and
  // faulted in anew at every call).
  thread_local std::vector<float> scratch;
  if (stats != nullptr) {
    const size_t need = static_cast<size_t>(s.B * s.K * s.R * s.C);
    if (scratch.size() < need) scratch.resize(need);
    probs = scratch.data();
  }
  const float* qd_ = q.typed_data();
  const int32_t* pos = qpos.typed_data();
  const KV* kbase = keys.typed_data() + s.layer * s.B * s.K * s.C * s.H;
  const KV* vbase = values.typed_data() + s.layer * s.B * s.K * s.C * s.H;
  const int32_t* kpbase = kpos.typed_data() + s.layer * s.B * s.K * s.C;
  const float* ksbase = k_scale ? k_scale + s.layer * s.B * s.K * s.C : nullptr;
  const float* vsbase = v_scale ? v_scale + s.layer * s.B * s.K * s.C : nullptr;

  const ChunkFn<KV> chunk_fn = pick<KV>(s);
  auto attend_chunk = [&](int64_t i) {
    std::vector<int32_t> rowpos(s.R);
    const int64_t bk = i / n_chunks, chunk = i % n_chunks, b = bk / s.K;
    for (int64_t r = 0; r < s.R; ++r) rowpos[r] = pos[b * s.T + r % s.T];
    const int64_t c0 = chunk * kChunk, c1 = std::min(s.C, c0 + kChunk);
    float* part = partial.data() + i * per_item;
    chunk_fn(s, qd_ + bk * s.R * s.H, rowpos.data(), kbase + bk * s.C * s.H,
             vbase + bk * s.C * s.H, kpbase + bk * s.C, c0, c1, part, part + s.R,
             stats == nullptr ? nullptr : part + 2 * s.R, part + 3 * s.R,
             probs == nullptr ? nullptr : probs + bk * s.R * s.C,
             ksbase ? ksbase + bk * s.C : nullptr, vsbase ? vsbase + bk * s.C : nullptr);
  };

  // Merge the chunks of each row of (b, k) = bk: weights exp(m_chunk - m) of their partial
  // sums and outputs (``w``: one per chunk). With statistics, each chunk's factor over the
  // whole softmax (the new token included) goes to ``factor`` [B * K, chunks, R] and each
  // row's entropy to stats->entropy.
  std::vector<float> factor(stats == nullptr ? 0 : s.B * s.K * n_chunks * s.R);
  auto merge_pair = [&](int64_t bk, float* w) {
    for (int64_t r = 0; r < s.R; ++r) {
      const float* parts = partial.data() + bk * n_chunks * per_item;
      float top = kNegInf;
      for (int64_t c = 0; c < n_chunks; ++c) top = std::max(top, parts[c * per_item + r]);
      float sum = 0.0f;
      for (int64_t c = 0; c < n_chunks; ++c) {
        const float* part = parts + c * per_item;
        w[c] = part[s.R + r] == 0.0f ? 0.0f : exp_nonpositive(part[r] - top);
        sum += w[c] * part[s.R + r];
      }
      const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
      float* orow = o + (bk * s.R + r) * s.H;
      std::fill(orow, orow + s.H, 0.0f);
      for (int64_t c = 0; c < n_chunks; ++c) {
        if (w[c] == 0.0f) continue;
        const float* acc = parts + c * per_item + 3 * s.R + r * s.H;
        for (int64_t h = 0; h < s.H; ++h) orow[h] += w[c] * acc[h];
      }
      for (int64_t h = 0; h < s.H; ++h) orow[h] *= inv;
      om[bk * s.R + r] = top;
      ol[bk * s.R + r] = sum;
      if (stats != nullptr) {
        // The new token (T = 1: at the query's own position, seen unless the query is padding).
        const int64_t b = bk / s.K;
        const bool valid = pos[b] >= 0;
        const float* qr = qd_ + (bk * s.R + r) * s.H;
        const float* kn = stats->k_new + bk * s.H;
        float dot = 0.0f;
        for (int64_t h = 0; h < s.H; ++h) dot += qr[h] * kn[h];
        const float s_new = valid ? dot * s.scale : kNegInf;
        const float all_top = std::max(top, s_new);
        const float w_cache = sum * exp_nonpositive(top - all_top);
        const float e_new = valid ? exp_nonpositive(s_new - all_top) : 0.0f;
        const float total = std::max(w_cache + e_new, 1e-30f);
        // entropy = log(total) * sum p - sum p (s - all_top), over the slots and the new token
        float weighted = e_new * (s_new - all_top) / total, mass = e_new / total;
        for (int64_t c = 0; c < n_chunks; ++c) {
          const float* part = parts + c * per_item;
          const float fc = w[c] * exp_nonpositive(top - all_top) / total;
          factor[(bk * n_chunks + c) * s.R + r] = fc;
          if (fc == 0.0f) continue;
          weighted += fc * (part[2 * s.R + r] + (part[r] - all_top) * part[s.R + r]);
          mass += fc * part[s.R + r];
        }
        stats->entropy[bk * s.R + r] = valid ? std::log(total) * mass - weighted : 0.0f;
        continue;
      }
      if (probs == nullptr) continue;
      float* prow = probs + (bk * s.R + r) * s.C;
      for (int64_t c = 0; c < n_chunks; ++c) {
        const float f = w[c] * inv;
        const int64_t c0 = c * kChunk, c1 = std::min(s.C, c0 + kChunk);
#pragma omp simd
        for (int64_t j = c0; j < c1; ++j) prow[j] *= f;
      }
    }
  };
  auto update_pair_chunk = [&](int64_t bk, int64_t chunk) {
    const int64_t c0 = chunk * kChunk, c1 = std::min(s.C, c0 + kChunk);
    update_stats(s, *stats, bk, c0, c1, probs + bk * s.R * s.C,
                 factor.data() + (bk * n_chunks + chunk) * s.R, stats->entropy + bk * s.R,
                 pos[bk / s.K] >= 0);
  };

  if (stats != nullptr && s.B * s.K >= kFusedPairs) {
    // Statistics with many (b, k) pairs: each pair's chunks, merge and statistics in one work
    // item, its exponentials still in the core's cache when the statistics read them, and
    // one pass over the thread pool instead of two.
    ParallelFor(pool, s.B * s.K, [&](int64_t bk) {
      std::vector<float> w(n_chunks);
      for (int64_t c = 0; c < n_chunks; ++c) attend_chunk(bk * n_chunks + c);
      merge_pair(bk, w.data());
      for (int64_t c = 0; c < n_chunks; ++c) update_pair_chunk(bk, c);
    });
    return ffi::Error::Success();
  }
  ParallelFor(pool, n_items, attend_chunk);
  std::vector<float> w(n_chunks);
  for (int64_t bk = 0; bk < s.B * s.K; ++bk) merge_pair(bk, w.data());
  if (stats != nullptr)
    ParallelFor(pool, n_items, [&](int64_t i) { update_pair_chunk(i / n_chunks, i % n_chunks); });
  return ffi::Error::Success();
}

template <ffi::DataType KVType>
ffi::Error CacheAttention(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> qpos,
                          ffi::Buffer<KVType> keys, ffi::Buffer<KVType> values,
                          ffi::Buffer<ffi::S32> kpos, ffi::Buffer<ffi::S32> layer,
                          ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> out_m,
                          ffi::ResultBuffer<ffi::F32> out_l, int64_t window, float scale) {
  return Attend<KVType>(pool, q, qpos, keys, values, kpos, layer, out->typed_data(),
                        out_m->typed_data(), out_l->typed_data(), nullptr, nullptr, nullptr,
                        window, scale);
}

template <ffi::DataType KVType>
ffi::Error CacheAttentionProbs(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::S32> qpos, ffi::Buffer<KVType> keys,
                               ffi::Buffer<KVType> values, ffi::Buffer<ffi::S32> kpos,
                               ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out,
                               ffi::ResultBuffer<ffi::F32> out_m, ffi::ResultBuffer<ffi::F32> out_l,
                               ffi::ResultBuffer<ffi::F32> out_p, int64_t window, float scale) {
  return Attend<KVType>(pool, q, qpos, keys, values, kpos, layer, out->typed_data(),
                        out_m->typed_data(), out_l->typed_data(), out_p->typed_data(), nullptr,
                        nullptr, window, scale);
}

// An int8 cache: its per-slot key and value scales [L, B, K, C] follow the positions.
ffi::Error CacheAttentionInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::S32> qpos, ffi::Buffer<ffi::S8> keys,
                              ffi::Buffer<ffi::S8> values, ffi::Buffer<ffi::S32> kpos,
                              ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                              ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out,
                              ffi::ResultBuffer<ffi::F32> out_m, ffi::ResultBuffer<ffi::F32> out_l,
                              int64_t window, float scale) {
  return Attend<ffi::S8>(pool, q, qpos, keys, values, kpos, layer, out->typed_data(),
                         out_m->typed_data(), out_l->typed_data(), nullptr,
                         k_scale.typed_data(), v_scale.typed_data(), window, scale);
}

ffi::Error CacheAttentionProbsInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                   ffi::Buffer<ffi::S32> qpos, ffi::Buffer<ffi::S8> keys,
                                   ffi::Buffer<ffi::S8> values, ffi::Buffer<ffi::S32> kpos,
                                   ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                                   ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out,
                                   ffi::ResultBuffer<ffi::F32> out_m,
                                   ffi::ResultBuffer<ffi::F32> out_l,
                                   ffi::ResultBuffer<ffi::F32> out_p, int64_t window, float scale) {
  return Attend<ffi::S8>(pool, q, qpos, keys, values, kpos, layer, out->typed_data(),
                         out_m->typed_data(), out_l->typed_data(), out_p->typed_data(),
                         k_scale.typed_data(), v_scale.typed_data(), window, scale);
}

// The statistics' stacked arrays (inputs, then the outputs XLA aliases to them, in the order
// of the bits of ``which``: attn, attn_sq, attn_cum, recent, recent_ent) into ``st``; an
// output that is not its input's buffer gets the input's values first.
ffi::Error bind_stats(ffi::RemainingArgs& in, ffi::RemainingRets& out, int64_t which,
                      const ffi::Buffer<ffi::S32>& kpos, Stats& st) {
  size_t n = 0;
  for (int i = 0; i < kNumStats; ++i) {
    st.stat[i] = nullptr;
    if (!((which >> i) & 1)) continue;
    auto a = in.get<ffi::Buffer<ffi::F32>>(n);
    auto r = out.get<ffi::Buffer<ffi::F32>>(n);
    if (!a.has_value() || !r.has_value())
      return ffi::Error::InvalidArgument("cache_attention: a statistic is not float32");
    ++n;
    if (a->element_count() != kpos.element_count() || (*r)->element_count() != a->element_count())
      return ffi::Error::InvalidArgument("cache_attention: statistics [L, B, K, C] as the positions");
    float* dst = (*r)->typed_data();
    if (dst != a->typed_data())
      std::memcpy(dst, a->typed_data(), a->element_count() * sizeof(float));
    st.stat[i] = dst;
  }
  if (n != in.size() || n != out.size())
    return ffi::Error::InvalidArgument("cache_attention: one statistic array per bit of which");
  return ffi::Error::Success();
}

template <ffi::DataType KVType>
ffi::Error StatsAttend(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q,
                       ffi::Buffer<ffi::S32>& qpos, ffi::Buffer<KVType>& keys,
                       ffi::Buffer<KVType>& values, ffi::Buffer<ffi::S32>& kpos,
                       const float* k_scale, const float* v_scale, ffi::Buffer<ffi::F32>& k_new,
                       ffi::Buffer<ffi::S32>& layer, ffi::RemainingArgs& stat_in,
                       ffi::ResultBuffer<ffi::F32>& out, ffi::ResultBuffer<ffi::F32>& out_m,
                       ffi::ResultBuffer<ffi::F32>& out_l, ffi::ResultBuffer<ffi::F32>& out_ent,
                       ffi::RemainingRets& stat_out, int64_t window, float scale, float lam,
                       int64_t which) {
  auto qd = q.dimensions();
  if (qd.size() != 4 || k_new.element_count() != qd[0] * qd[1] * qd[3])
    return ffi::Error::InvalidArgument("cache_attention: k_new [B, K, H]");
  Stats st{};
  st.k_new = k_new.typed_data();
  st.entropy = out_ent->typed_data();
  st.lam = lam;
  if (ffi::Error e = bind_stats(stat_in, stat_out, which, kpos, st);
      e.failure())
    return e;
  return Attend<KVType>(pool, q, qpos, keys, values, kpos, layer, out->typed_data(),
                        out_m->typed_data(), out_l->typed_data(), nullptr, k_scale, v_scale,
                        window, scale, &st);
}

template <ffi::DataType KVType>
ffi::Error CacheAttentionStats(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                               ffi::Buffer<ffi::S32> qpos, ffi::Buffer<KVType> keys,
                               ffi::Buffer<KVType> values, ffi::Buffer<ffi::S32> kpos,
                               ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::S32> layer,
                               ffi::RemainingArgs stat_in, ffi::ResultBuffer<ffi::F32> out,
                               ffi::ResultBuffer<ffi::F32> out_m, ffi::ResultBuffer<ffi::F32> out_l,
                               ffi::ResultBuffer<ffi::F32> out_ent, ffi::RemainingRets stat_out,
                               int64_t window, float scale, float lam, int64_t which) {
  return StatsAttend<KVType>(pool, q, qpos, keys, values, kpos, nullptr, nullptr, k_new, layer,
                             stat_in, out, out_m, out_l, out_ent, stat_out, window, scale, lam,
                             which);
}

ffi::Error CacheAttentionStatsInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                                   ffi::Buffer<ffi::S32> qpos, ffi::Buffer<ffi::S8> keys,
                                   ffi::Buffer<ffi::S8> values, ffi::Buffer<ffi::S32> kpos,
                                   ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                                   ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::S32> layer,
                                   ffi::RemainingArgs stat_in, ffi::ResultBuffer<ffi::F32> out,
                                   ffi::ResultBuffer<ffi::F32> out_m,
                                   ffi::ResultBuffer<ffi::F32> out_l,
                                   ffi::ResultBuffer<ffi::F32> out_ent,
                                   ffi::RemainingRets stat_out, int64_t window, float scale,
                                   float lam, int64_t which) {
  return StatsAttend<ffi::S8>(pool, q, qpos, keys, values, kpos, k_scale.typed_data(),
                              v_scale.typed_data(), k_new, layer, stat_in, out, out_m, out_l,
                              out_ent, stat_out, window, scale, lam, which);
}

}  // namespace

// The same signature for each storage type of the cache; the ``Probs`` targets also return
// the probabilities of the cache slots (for the attention statistics).
// The queries, their positions, the keys, the values and the slots' positions.
#define JAXKV_BIND_CACHE(kv_type)          \
  ffi::Ffi::Bind()                         \
      .Ctx<ffi::ThreadPool>()              \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Arg<ffi::Buffer<ffi::S32>>()        \
      .Arg<ffi::Buffer<kv_type>>()         \
      .Arg<ffi::Buffer<kv_type>>()         \
      .Arg<ffi::Buffer<ffi::S32>>()

#define JAXKV_BIND(kv_type)                \
  JAXKV_BIND_CACHE(kv_type)                \
      .Arg<ffi::Buffer<ffi::S32>>()        \
      .Ret<ffi::Buffer<ffi::F32>>()        \
      .Ret<ffi::Buffer<ffi::F32>>()        \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvCacheAttentionF32, CacheAttention<ffi::F32>,
                              JAXKV_BIND(ffi::F32).Attr<int64_t>("window").Attr<float>("scale"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvCacheAttentionF16, CacheAttention<ffi::F16>,
                              JAXKV_BIND(ffi::F16).Attr<int64_t>("window").Attr<float>("scale"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvCacheAttentionProbsF32, CacheAttentionProbs<ffi::F32>,
                              JAXKV_BIND(ffi::F32)
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvCacheAttentionProbsF16, CacheAttentionProbs<ffi::F16>,
                              JAXKV_BIND(ffi::F16)
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale"));

#define JAXKV_BIND_INT8                  \
  JAXKV_BIND_CACHE(ffi::S8)              \
      .Arg<ffi::Buffer<ffi::F32>>()      \
      .Arg<ffi::Buffer<ffi::F32>>()      \
      .Arg<ffi::Buffer<ffi::S32>>()      \
      .Ret<ffi::Buffer<ffi::F32>>()      \
      .Ret<ffi::Buffer<ffi::F32>>()      \
      .Ret<ffi::Buffer<ffi::F32>>()

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvCacheAttentionS8, CacheAttentionInt8,
                              JAXKV_BIND_INT8.Attr<int64_t>("window").Attr<float>("scale"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvCacheAttentionProbsS8, CacheAttentionProbsInt8,
                              JAXKV_BIND_INT8.Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("window")
                                  .Attr<float>("scale"));

// The ``Stats`` targets: the new token's key [B, K, H] and the layer, then the statistics'
// stacked arrays; returned: the output, m, l, the rows' entropies [B, K, R], then the
// statistics (aliased to their inputs).
#define JAXKV_STATS_ATTRS                 \
  .Attr<int64_t>("window")                \
      .Attr<float>("scale")               \
      .Attr<float>("lam")                 \
      .Attr<int64_t>("which")

// After the cache's arguments (and an int8 cache's two scales): k_new, the layer, then the
// statistics.
#define JAXKV_BIND_STATS(bound)           \
  bound.Arg<ffi::Buffer<ffi::F32>>()      \
      .Arg<ffi::Buffer<ffi::S32>>()       \
      .RemainingArgs()                    \
      .Ret<ffi::Buffer<ffi::F32>>()       \
      .Ret<ffi::Buffer<ffi::F32>>()       \
      .Ret<ffi::Buffer<ffi::F32>>()       \
      .Ret<ffi::Buffer<ffi::F32>>()       \
      .RemainingRets() JAXKV_STATS_ATTRS

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvCacheAttentionStatsF32, CacheAttentionStats<ffi::F32>,
                              JAXKV_BIND_STATS(JAXKV_BIND_CACHE(ffi::F32)));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvCacheAttentionStatsF16, CacheAttentionStats<ffi::F16>,
                              JAXKV_BIND_STATS(JAXKV_BIND_CACHE(ffi::F16)));
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvCacheAttentionStatsS8, CacheAttentionStatsInt8,
                              JAXKV_BIND_STATS(JAXKV_BIND_CACHE(ffi::S8)
                                                   .Arg<ffi::Buffer<ffi::F32>>()
                                                   .Arg<ffi::Buffer<ffi::F32>>()));
