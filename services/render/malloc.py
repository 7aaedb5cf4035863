"""glibc's allocator, set for the tokenizer's allocation pattern (process-wide, once at start).

Tokenizing a long prompt allocates and frees many buffers, some of them hundreds of KiB (the
tokenizer keeps an alignment pair per byte of text, copied for every piece it splits off). With
glibc's defaults the heap top is handed back to the kernel after such a request and faulted in
again by the next one, and buffers past the mmap threshold are mapped and unmapped each time:
malloc, free and their page faults were ~35% of the tokenizer's CPU (perf, the render bench's
long prompts). Keeping a bounded slack instead cut the render service's CPU per request ~6%.

The slack is per arena: the main one and, since glibc 2.26, each arena a tokenizing thread
takes (`workers` threads) may keep up to the trim threshold plus the top pad free (~80 MiB
each) rather than hand it back. A render process's memory limit should allow for it.
"""

from __future__ import annotations

import ctypes
import logging
import platform

log = logging.getLogger(__name__)

# mallopt(3) parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3

SETTINGS = {
    # free memory kept at the heap top before trimming: a few long requests' worth
    M_TRIM_THRESHOLD: 64 << 20,
    # grow the heap in steps this large, so a long request does not fault it in page by page
    M_TOP_PAD: 16 << 20,
    # buffers below this come from the heap; glibc's own adaptive ceiling, fixed from the start
    # (setting the others turns its adaptation off)
    M_MMAP_THRESHOLD: 32 << 20,
}


def tune_for_tokenizing() -> bool:
    """Apply `SETTINGS` where the C library is glibc (each one tried, a refused one logged);
    False: one was refused, or the C library is not glibc (nothing to tune)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)
    refused = [param for param, value in SETTINGS.items() if libc.mallopt(param, value) != 1]
    for param in refused:
        log.warning("render.malloc refused mallopt(%d, %d)", param, SETTINGS[param])
    return not refused
