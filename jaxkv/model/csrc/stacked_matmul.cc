// A few rows times one layer of a stacked weight, read in place: y = x @ w[layer].T for
// x [T, I] float32 and w [L, O, I] stored output channels first (float32, or int8 with one
// float32 scale per output channel, [L, O, 1]); an XLA FFI target for the CPU
// (jaxkv/model/cache_kernel.py builds, loads and calls it).
//
// XLA:CPU copies a layer's slice of the stacked weights out before a dot with 2-64 rows
// (results/profile_decode.md), so a batch-8 decode step wrote and read every weight twice.
// Here each weight row is read once for up to 8 rows of x at a time (T * O dot products of
// length I, kept in vector registers: TO outputs x TT rows per tile), and the output channels
// are cut into work items that run on XLA's intra-op thread pool. An int8 weight is widened
// as it is loaded and scaled once per output.
#include <cstdint>

#include "simd.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace jaxkv_simd;

constexpr int64_t kRowsPerItem = 32;  // output channels per work item

inline float widen1(float x) { return x; }
inline float widen1(int8_t x) { return static_cast<float>(x); }
// Outputs [o, o + TO) of rows [t, t + TT): TO * TT accumulators of kLanes each, the weight
// rows read once for the TT rows.
template <typename W, int TO, int TT>
inline void Tile(const float* x, const W* w, const float* scale, float* y, int64_t I, int64_t O,
                 int64_t o, int64_t t) {
  const int64_t I16 = I - I % kLanes;
  vf acc[TO][TT] = {};
  // The tile after next is prefetched a line per row as this one advances: spread out, not
  // as one burst at the tile's start (1.15x faster at 8 rows of float32 weights, session 48).
  const W* ahead = w + (o + 2 * TO) * I;
  for (int64_t i = 0; i < I16; i += kLanes) {
    if ((i * sizeof(W)) % 64 == 0)
      for (int a = 0; a < TO; ++a) prefetch(ahead + a * I + i);
    vf wv[TO];
    for (int a = 0; a < TO; ++a) wv[a] = load(w + (o + a) * I + i);
    for (int c = 0; c < TT; ++c) {
      const vf xv = load(x + (t + c) * I + i);
      for (int a = 0; a < TO; ++a) acc[a][c] += wv[a] * xv;
    }
  }
  for (int a = 0; a < TO; ++a) {
    for (int c = 0; c < TT; ++c) {
      float s = hsum(acc[a][c]);
      for (int64_t i = I16; i < I; ++i) s += widen1(w[(o + a) * I + i]) * x[(t + c) * I + i];
      y[(t + c) * O + o + a] = scale ? s * scale[o + a] : s;
    }
  }
}

// Outputs [o0, o1) of rows [t, t + TT), TO at a time (then one at a time at the end).
template <typename W, int TO, int TT>
void Rows(const float* x, const W* w, const float* scale, float* y, int64_t I, int64_t O,
          int64_t o0, int64_t o1, int64_t t) {
  int64_t o = o0;
  for (; o + TO <= o1; o += TO) Tile<W, TO, TT>(x, w, scale, y, I, O, o, t);
  for (; o < o1; ++o) Tile<W, 1, TT>(x, w, scale, y, I, O, o, t);
}

// Output channels [o0, o1) of one row of x (a decode step at batch 1): each channel's weights
// read whole, in memory order, so a work item is one sequential stream (the tiles above read
// TO rows side by side, TO short streams that the hardware prefetcher meets anew at every
// tile), four accumulators per channel.
template <typename W>
void OneRow(const float* x, const W* w, const float* scale, float* y, int64_t I, int64_t o0,
            int64_t o1) {
  constexpr int64_t kStep = 4 * kLanes;
  const int64_t I4 = I - I % kStep, I1 = I - I % kLanes;
  for (int64_t o = o0; o < o1; ++o) {
    const W* row = w + o * I;
    vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
    int64_t i = 0;
    for (; i < I4; i += kStep) {
      prefetch_ahead(row + i, kStep * sizeof(W));
      a0 += load(row + i) * load(x + i);
      a1 += load(row + i + kLanes) * load(x + i + kLanes);
      a2 += load(row + i + 2 * kLanes) * load(x + i + 2 * kLanes);
      a3 += load(row + i + 3 * kLanes) * load(x + i + 3 * kLanes);
    }
    for (; i < I1; i += kLanes) a0 += load(row + i) * load(x + i);
    float s = hsum((a0 + a1) + (a2 + a3));
    for (; i < I; ++i) s += widen1(row[i]) * x[i];
    y[o] = scale ? s * scale[o] : s;
  }
}

// Output channels [o0, o1) of all T rows, in groups of 8, 4, 2 or 1 rows; each group's tile
// keeps kAcc accumulators (half the vector registers).
template <typename W>
void Block(const float* x, const W* w, const float* scale, float* y, int64_t T, int64_t I,
           int64_t O, int64_t o0, int64_t o1) {
  if (T == 1) return OneRow<W>(x, w, scale, y, I, o0, o1);
  constexpr int kAcc = kLanes == 16 ? 16 : 8;
  int64_t t = 0;
  for (; t + 8 <= T; t += 8) Rows<W, kAcc / 8, 8>(x, w, scale, y, I, O, o0, o1, t);
  if (t + 4 <= T) Rows<W, kAcc / 4, 4>(x, w, scale, y, I, O, o0, o1, t), t += 4;
  if (t + 2 <= T) Rows<W, kAcc / 2, 2>(x, w, scale, y, I, O, o0, o1, t), t += 2;
  if (t < T) Rows<W, kAcc / 2, 1>(x, w, scale, y, I, O, o0, o1, t);
}

template <typename W>
ffi::Error Run(ffi::ThreadPool& pool, const float* x, const W* wbase, const float* sbase,
               int64_t L, int64_t O, int64_t I, int64_t T, int64_t layer, float* y) {
  if (layer < 0 || layer >= L) return ffi::Error::InvalidArgument("stacked_matmul: layer out of range");
  const W* w = wbase + layer * O * I;
  const float* scale = sbase ? sbase + layer * O : nullptr;
  const int64_t n_items = (O + kRowsPerItem - 1) / kRowsPerItem;
  ParallelFor(pool, n_items, [&](int64_t item) {
    const int64_t o0 = item * kRowsPerItem, o1 = std::min(O, o0 + kRowsPerItem);
    Block<W>(x, w, scale, y, T, I, O, o0, o1);
  });
  return ffi::Error::Success();
}

ffi::Error MatmulF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[2])
    return ffi::Error::InvalidArgument("stacked_matmul: x [T, I], w [L, O, I]");
  return Run<float>(pool, x.typed_data(), w.typed_data(), nullptr, wd[0], wd[1], wd[2], xd[0],
                    layer.typed_data()[0], y->typed_data());
}

ffi::Error MatmulS8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                    ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::S32> layer,
                    ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || xd[1] != wd[2])
    return ffi::Error::InvalidArgument("stacked_matmul: x [T, I], w [L, O, I]");
  if (sd.size() != 3 || sd[0] != wd[0] || sd[1] != wd[1] || sd[2] != 1)
    return ffi::Error::InvalidArgument("stacked_matmul: scale [L, O, 1]");
  return Run<int8_t>(pool, x.typed_data(), w.typed_data(), scale.typed_data(), wd[0], wd[1],
                     wd[2], xd[0], layer.typed_data()[0], y->typed_data());
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvStackedMatmulF32, MatmulF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvStackedMatmulS8, MatmulS8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
