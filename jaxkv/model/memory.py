"""Huge pages for a model's weights on a Linux CPU.

A decode step at batch 1 streams every weight once; with 4 KiB pages that is a TLB miss and a
fresh start of the hardware prefetcher every 4 KiB. XLA:CPU allocates its buffers with plain
``malloc``, which Linux backs with 4 KiB pages unless a region is advised otherwise (the
usual ``transparent_hugepage`` setting is ``madvise``), while numpy advises its own large
arrays by default. ``huge_pages`` advises a pytree's large CPU buffers (``MADV_HUGEPAGE``) and
has the kernel move their contents into 2 MiB pages at once (``MADV_COLLAPSE``, Linux 6.1):
the same bytes at the same addresses. Session 50's host: a batch-1 float32 decode step
1.08-1.15x faster (results/bench_kernels_s50/). Anything else (another OS, a GPU buffer, an
older kernel, THP disabled) is left alone.
"""

from __future__ import annotations

import ctypes
import sys

import jax

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE, _MADV_COLLAPSE = 14, 25  # <linux/mman.h>


def huge_pages(tree) -> int:
    """Backs the 2 MiB-aligned part of every CPU ``jax.Array`` in ``tree`` with huge pages
    (best effort, contents unchanged). Returns the bytes the kernel collapsed (0 off Linux)."""
    if sys.platform != "linux":
        return 0
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    done = 0
    for start, stop in _aligned_ranges(tree):
        madvise(start, stop - start, _MADV_HUGEPAGE)
        if madvise(start, stop - start, _MADV_COLLAPSE) == 0:
            done += stop - start
    return done


def _aligned_ranges(tree) -> list[tuple[int, int]]:
    """[start, stop) of the whole huge pages inside each single-CPU-buffer array of ``tree``
    (computed first: a buffer still being written has no pages to collapse yet)."""
    out = []
    for a in jax.block_until_ready(jax.tree.leaves(tree)):
        if not isinstance(a, jax.Array) or a.nbytes < HUGE_PAGE:
            continue
        if len(a.devices()) != 1 or next(iter(a.devices())).platform != "cpu":
            continue
        p = a.unsafe_buffer_pointer()
        start, stop = -(-p // HUGE_PAGE) * HUGE_PAGE, (p + a.nbytes) // HUGE_PAGE * HUGE_PAGE
        if stop > start:
            out.append((start, stop))
    return out
