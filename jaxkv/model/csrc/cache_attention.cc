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
// their sum.
inline float exponentiate(float* __restrict sr, int64_t n, float top, float* __restrict probs) {
  float sum = 0.0f;
  if (top > kNegInf) {
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
                     float* __restrict l, float* __restrict acc, float* __restrict probs,
                     const float* __restrict ks, const float* __restrict vs) {
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
    l[r] = exponentiate(sr, n, top, probs == nullptr ? nullptr : probs + r * s.C + c0);
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
                 float* __restrict l, float* __restrict acc, float* __restrict probs,
                     const float* __restrict ks, const float* __restrict vs) {
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
    l[r] = exponentiate(sr, n, top, probs == nullptr ? nullptr : probs + r * s.C + c0);
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
                         const float*, const float*);

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

// The whole call; ``probs`` (null: not wanted) receives each row's probabilities over the
// cache slots, normalized over the cache [B, K, R, C].
template <ffi::DataType KVType>
ffi::Error Attend(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::S32>& qpos,
                  ffi::Buffer<KVType>& keys, ffi::Buffer<KVType>& values,
                  ffi::Buffer<ffi::S32>& kpos, ffi::Buffer<ffi::S32>& layer, float* o, float* om,
                  float* ol, float* probs, const float* k_scale, const float* v_scale,
                  int64_t window, float scale) {
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
  s.layer = layer.typed_data()[0];
  if (s.layer < 0 || s.layer >= kd[0]) {
    return ffi::Error::InvalidArgument("cache_attention: layer out of range");
  }
  const int64_t n_chunks = (s.C + kChunk - 1) / kChunk;
  const int64_t n_items = s.B * s.K * n_chunks;
  // per item: R maxima, R sums, R * H outputs
  const int64_t per_item = s.R * (2 + s.H);
  std::vector<float> partial(n_items * per_item);
  const float* qd_ = q.typed_data();
  const int32_t* pos = qpos.typed_data();
  const KV* kbase = keys.typed_data() + s.layer * s.B * s.K * s.C * s.H;
  const KV* vbase = values.typed_data() + s.layer * s.B * s.K * s.C * s.H;
  const int32_t* kpbase = kpos.typed_data() + s.layer * s.B * s.K * s.C;
  const float* ksbase = k_scale ? k_scale + s.layer * s.B * s.K * s.C : nullptr;
  const float* vsbase = v_scale ? v_scale + s.layer * s.B * s.K * s.C : nullptr;

  const ChunkFn<KV> chunk_fn = pick<KV>(s);
  ParallelFor(pool, n_items, [&](int64_t i) {
    std::vector<int32_t> rowpos(s.R);
    const int64_t bk = i / n_chunks, chunk = i % n_chunks, b = bk / s.K;
    for (int64_t r = 0; r < s.R; ++r) rowpos[r] = pos[b * s.T + r % s.T];
    const int64_t c0 = chunk * kChunk, c1 = std::min(s.C, c0 + kChunk);
    float* part = partial.data() + i * per_item;
    chunk_fn(s, qd_ + bk * s.R * s.H, rowpos.data(), kbase + bk * s.C * s.H,
             vbase + bk * s.C * s.H, kpbase + bk * s.C, c0, c1, part, part + s.R,
             part + 2 * s.R, probs == nullptr ? nullptr : probs + bk * s.R * s.C,
             ksbase ? ksbase + bk * s.C : nullptr, vsbase ? vsbase + bk * s.C : nullptr);
  });

  // Merge the chunks of each row: weights exp(m_chunk - m) of their partial sums and outputs.
  std::vector<float> w(n_chunks);
  for (int64_t bk = 0; bk < s.B * s.K; ++bk) {
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
        const float* acc = parts + c * per_item + 2 * s.R + r * s.H;
        for (int64_t h = 0; h < s.H; ++h) orow[h] += w[c] * acc[h];
      }
      for (int64_t h = 0; h < s.H; ++h) orow[h] *= inv;
      om[bk * s.R + r] = top;
      ol[bk * s.R + r] = sum;
      if (probs == nullptr) continue;
      float* prow = probs + (bk * s.R + r) * s.C;
      for (int64_t c = 0; c < n_chunks; ++c) {
        const float f = w[c] * inv;
        const int64_t c0 = c * kChunk, c1 = std::min(s.C, c0 + kChunk);
#pragma omp simd
        for (int64_t j = c0; j < c1; ++j) prow[j] *= f;
      }
    }
  }
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

}  // namespace

// The same signature for each storage type of the cache; the ``Probs`` targets also return
// the probabilities of the cache slots (for the attention statistics).
#define JAXKV_BIND(kv_type)                \
  ffi::Ffi::Bind()                         \
      .Ctx<ffi::ThreadPool>()              \
      .Arg<ffi::Buffer<ffi::F32>>()        \
      .Arg<ffi::Buffer<ffi::S32>>()        \
      .Arg<ffi::Buffer<kv_type>>()         \
      .Arg<ffi::Buffer<kv_type>>()         \
      .Arg<ffi::Buffer<ffi::S32>>()        \
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
  ffi::Ffi::Bind()                       \
      .Ctx<ffi::ThreadPool>()            \
      .Arg<ffi::Buffer<ffi::F32>>()      \
      .Arg<ffi::Buffer<ffi::S32>>()      \
      .Arg<ffi::Buffer<ffi::S8>>()       \
      .Arg<ffi::Buffer<ffi::S8>>()       \
      .Arg<ffi::Buffer<ffi::S32>>()      \
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
