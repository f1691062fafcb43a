"""Huge pages for the weights (``jaxkv.model.memory``): the kernel reports the buffers in 2 MiB
pages afterwards (``/proc/self/smaps``, read independently of the call's own count), the
values are unchanged, small or non-array leaves are left alone, and ``jaxkv.load`` applies it."""

import os
import re
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

import jaxkv
from jaxkv.model import memory

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _collapse_supported() -> bool:
    """Linux 6.1 or later (MADV_COLLAPSE) with transparent huge pages not disabled."""
    if sys.platform != "linux" or not THP.exists() or "[never]" in THP.read_text():
        return False
    major, minor = (int(x) for x in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
    return (major, minor) >= (6, 1)


needs_collapse = pytest.mark.skipif(
    not _collapse_supported(), reason="needs Linux >= 6.1 with transparent huge pages"
)


def huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address`` (kB), from /proc/self/smaps."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if m and int(m[1], 16) <= address < int(m[2], 16):
            for field in lines[i + 1 :]:
                if field.startswith("AnonHugePages:"):
                    return int(field.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


@needs_collapse
def test_a_large_buffer_moves_into_huge_pages_with_its_values():
    a = jnp.arange(4 * memory.HUGE_PAGE // 4, dtype=jnp.float32) * 0.5 + 1.0  # 8 MiB
    want = np.asarray(a).copy()
    done = memory.huge_pages({"w": a})
    assert done >= 2 * memory.HUGE_PAGE  # at least the 3 whole pages inside, bar rounding
    assert huge_kib(a.unsafe_buffer_pointer() + a.nbytes // 2) >= memory.HUGE_PAGE // 1024
    np.testing.assert_array_equal(np.asarray(a), want)


def test_small_and_non_array_leaves_are_left_alone():
    tree = {"small": jnp.ones(1000), "number": 3, "numpy": np.ones(2 * memory.HUGE_PAGE)}
    assert memory.huge_pages(tree) == 0
    assert memory._aligned_ranges(tree) == []


@needs_collapse
def test_load_puts_the_out_first_weights_in_huge_pages():
    model = jaxkv.load("smollm2-135m", out_first=True)
    w = model.params["layers"]["w_up"].values  # 106 MB, computed by the transposition
    assert huge_kib(w.unsafe_buffer_pointer() + w.nbytes // 2) > 0
