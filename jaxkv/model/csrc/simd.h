// What the compiled CPU kernels share (jaxkv/model/csrc/*.cc, built into one library by
// jaxkv/model/cache_kernel.py, whose build key covers this header too): the CPU's widest
// float vector as a GCC vector type (16 lanes with AVX-512, else 8), loads that widen int8
// and float16 storage, exp for arguments <= 0 in scalar and vector form, and a parallel loop
// on XLA's intra-op thread pool.
#ifndef JAXKV_MODEL_CSRC_SIMD_H_
#define JAXKV_MODEL_CSRC_SIMD_H_

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxkv_simd {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
typedef float vf __attribute__((vector_size(4 * kLanes)));
typedef int32_t vi __attribute__((vector_size(4 * kLanes)));

inline vf load(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline vf load(const uint16_t* p) {  // float16 storage, widened by the CPU's F16C
  vf v;
#if defined(__AVX512F__)
  const __m512 w = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  std::memcpy(&v, &w, sizeof(v));
#elif defined(__F16C__)
  const __m256 w = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  std::memcpy(&v, &w, sizeof(v));
#else
  for (int u = 0; u < kLanes; ++u) {
    _Float16 h;
    std::memcpy(&h, p + u, sizeof(h));
    v[u] = static_cast<float>(h);
  }
#endif
  return v;
}

inline vf load(const int8_t* p) {  // int8 storage, widened (sign-extended)
  vf v;
#if defined(__AVX512F__)
  const __m512 w = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&v, &w, sizeof(v));
#elif defined(__AVX2__)
  const __m256 w = _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  std::memcpy(&v, &w, sizeof(v));
#else
  for (int u = 0; u < kLanes; ++u) v[u] = static_cast<float>(p[u]);
#endif
  return v;
}

inline void store(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }

// Asks for the cache line holding p, to be read soon (the kernels stream their keys, values
// and weights once each, with little work per line: the hardware prefetcher alone left them
// waiting on memory; the int8 attention ran 1.45x faster with it, float32 1.2x, one thread).
inline void prefetch(const void* p) { __builtin_prefetch(p, 0, 3); }

// The lines of [p + kPrefetchAhead, p + kPrefetchAhead + bytes), while a streaming loop works
// on [p, p + bytes).
constexpr int64_t kPrefetchAhead = 2048;

inline void prefetch_ahead(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p) + kPrefetchAhead;
  for (int64_t b = 0; b < bytes; b += 64) prefetch(c + b);
}

inline float hsum(vf v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

// exp(x) for x <= 0 (scores minus their maximum): 2^n * p(r) with x = n ln 2 + r,
// |r| <= ln 2 / 2, p the degree-6 Taylor polynomial (relative error < 2e-7); arguments below
// -87 give 0 in the vector form, 2^-126 * p in the scalar one (callers treat hidden keys
// apart).
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693145751953125f, kLn2Lo = 1.42860682030941723e-06f;

template <typename T>
inline T exp_polynomial(T r) {
  T p = r * (1.0f / 720.0f) + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  return p * r + 1.0f;
}

inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * kLog2e);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return exp_polynomial(x - n * kLn2Hi - n * kLn2Lo) * scale;
}

inline vf exp_nonpositive(vf x) {
  const vi under = x < -87.0f;
  x = under ? vf{} - 87.0f : x;
  const vf magic = vf{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const vf t = x * kLog2e + magic;
  const vf n = t - magic;
  const vi bits = (((vi)t - (vi)magic) + 127) << 23;
  const vf e = exp_polynomial(x - n * kLn2Hi - n * kLn2Lo) * (vf)bits;
  return under ? vf{} : e;
}

// fn(i) for every i in [0, n), on the calling thread and up to pool.num_threads() - 1 of XLA's
// intra-op threads taking items in order; returns when all are done.
template <typename Fn>
void ParallelFor(xla::ffi::ThreadPool& pool, int64_t n, Fn fn) {
  struct Work {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto work = std::make_shared<Work>();
  auto run = [=]() {
    for (;;) {
      const int64_t i = work->next.fetch_add(1);
      if (i >= n) return;
      fn(i);
      work->done.fetch_add(1);
    }
  };
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), n) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule(decltype(run)(run));
  run();
  while (work->done.load() < n) std::this_thread::yield();
}

}  // namespace jaxkv_simd

#endif  // JAXKV_MODEL_CSRC_SIMD_H_
