"""glibc's malloc set up for a training process: memory it frees stays in the process, for the next step.

By default glibc hands the top of its heap back to the system as soon as more than a threshold (adjusted as the
process runs) lies free there, and it serves blocks above another threshold straight from mmap. A training step on
a CPU allocates and frees buffers of a few megabytes every time (fp32 convolutions' buffers, the augmentation's
intermediate batches), so every step faulted their pages in again: about 10,000 page faults per step of the default
recipe in fp32, a third of its time. Keeping freed memory, as jemalloc and tcmalloc do, costs only that the heap's
peak stays resident.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters, from glibc's malloc.h
MMAP_THRESHOLD = 32 * 2**20  # the largest glibc accepts on 64-bit: smaller blocks come from the heap
TRIM_THRESHOLD = 2**30  # free memory at the top of the heap is given back only beyond this
ENVIRONMENT = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_")  # glibc's own settings, which are left alone


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory for reuse; False where the C library is not glibc or the
    environment already sets these thresholds (the user's choice stands)."""
    if platform.libc_ver()[0] != "glibc" or any(name in os.environ for name in ENVIRONMENT):
        return False
    libc = ctypes.CDLL(None)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
