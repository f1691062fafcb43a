// Eviction's selection, in place: in every row of a cache's slot positions, the lowest-scored
// occupied slots beyond the row's budget are freed (pos = -1); an XLA FFI target for the CPU
// (jaxkv/model/cache_kernel.py builds, loads and calls it; jaxkv/eviction.py's drop_mask
// defines the selection).
//
// Row r keeps ``keep[r]`` of its occupied slots and frees the n = min(occupied - keep, m)
// others with the lowest scores, ties to the lower slot index; -0.0 ties 0.0, a NaN score
// ranks above +inf (kept first) and an empty slot (an infinite score) below every finite one,
// as drop_mask's order key (jaxkv.topn.order_key of the negated score) ranks them. XLA's
// top_k and bisection over the rows each went through memory several times, single-threaded
// (about 2 ms per eviction of one slot per row at batch 8 x 4K, r = 0.25, per KV head);
// here each row is read once: with few drops its n best candidates stay in a small sorted
// buffer, with many (after prefill) a partial sort picks them. Rows run on XLA's threads.
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

constexpr int64_t kRowsPerItem = 16;
constexpr int64_t kBufferedDrops = 64;  // up to this many drops per row: the sorted buffer

// The order of drop_mask's key, order_key(-score) (larger: dropped first), with the slot
// index below it (lower index first among equal keys): one unique 64-bit value per slot.
inline uint64_t drop_rank(float score, bool occupied, int64_t c) {
  uint32_t key;
  if (!occupied) {
    key = 0x007FFFFFu;  // order_key(-inf)
  } else if (std::isnan(score)) {
    key = 0u;
  } else {
    float x = -score;
    if (x == 0.0f) x = 0.0f;  // -0.0 ties 0.0
    uint32_t bits;
    std::memcpy(&bits, &x, sizeof(bits));
    key = bits >= 0x80000000u ? ~bits : (bits | 0x80000000u);
  }
  return (static_cast<uint64_t>(key) << 32) | (0xFFFFFFFFu - static_cast<uint32_t>(c));
}

inline int64_t slot_of(uint64_t rank) { return 0xFFFFFFFFu - static_cast<uint32_t>(rank); }

void Row(const float* __restrict s, int32_t* __restrict pos, int64_t C, int64_t keep,
         int64_t m, std::vector<uint64_t>& scratch) {
  int64_t occupied = 0;
  for (int64_t c = 0; c < C; ++c) occupied += pos[c] >= 0;
  const int64_t n = std::min(std::max<int64_t>(occupied - keep, 0), std::min(m, C));
  if (n == 0) return;
  if (n <= kBufferedDrops) {
    // The n largest ranks so far, ascending (buf[0] the smallest kept).
    uint64_t buf[kBufferedDrops];
    for (int64_t c = 0; c < n; ++c) buf[c] = drop_rank(s[c], pos[c] >= 0, c);
    std::sort(buf, buf + n);
    for (int64_t c = n; c < C; ++c) {
      const uint64_t v = drop_rank(s[c], pos[c] >= 0, c);
      if (v <= buf[0]) continue;
      int64_t i = 1;
      while (i < n && buf[i] < v) {
        buf[i - 1] = buf[i];
        ++i;
      }
      buf[i - 1] = v;
    }
    for (int64_t i = 0; i < n; ++i) pos[slot_of(buf[i])] = -1;
    return;
  }
  scratch.resize(C);
  for (int64_t c = 0; c < C; ++c) scratch[c] = drop_rank(s[c], pos[c] >= 0, c);
  std::nth_element(scratch.begin(), scratch.begin() + (n - 1), scratch.end(),
                   std::greater<uint64_t>());
  for (int64_t i = 0; i < n; ++i) pos[slot_of(scratch[i])] = -1;
}

ffi::Error DropLowest(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> scores,
                      ffi::Buffer<ffi::S32> pos, ffi::Buffer<ffi::S32> keep,
                      ffi::ResultBuffer<ffi::S32> out, int64_t max_drop) {
  auto sd = scores.dimensions();
  if (sd.size() < 1 || pos.element_count() != scores.element_count())
    return ffi::Error::InvalidArgument("drop_lowest: scores and positions [..., C] alike");
  const int64_t C = sd[sd.size() - 1];
  const int64_t R = C == 0 ? 0 : scores.element_count() / C;
  if (keep.element_count() != R)
    return ffi::Error::InvalidArgument("drop_lowest: one budget per row");
  int32_t* o = out->typed_data();
  if (o != pos.typed_data())
    std::memcpy(o, pos.typed_data(), pos.element_count() * sizeof(int32_t));
  const float* s = scores.typed_data();
  const int32_t* k = keep.typed_data();
  const int64_t n_items = (R + kRowsPerItem - 1) / kRowsPerItem;
  ParallelFor(pool, n_items, [&](int64_t item) {
    std::vector<uint64_t> scratch;
    const int64_t r1 = std::min(R, (item + 1) * kRowsPerItem);
    for (int64_t r = item * kRowsPerItem; r < r1; ++r)
      Row(s + r * C, o + r * C, C, k[r], max_drop, scratch);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxkvDropLowest, DropLowest,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("max_drop"));
