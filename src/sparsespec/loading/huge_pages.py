"""The memory the engine's weights stream from: transparent huge pages, reached without making a start wait.

Native decoding reads every weight once per step, and reads it faster from private anonymous memory in 2 MiB
pages than from 4 KiB pages (fewer TLB misses, hardware prefetch that runs across a whole page): fastest from
anonymous huge pages, a little slower from its stored file mapped (mostly in huge page-cache folios), slowest from
anonymous 4 KiB pages. But a fresh huge page can be slow to get: on a virtual machine that hands free memory back
to its host, each one is faulted in from the host, and filling a model's weights that way takes seconds of kernel
time whenever the process starts more than a few seconds after the last, where back to back, in 4 KiB pages or by
mapping the file it takes a fraction of a second. Measured in
benchmarks/history/serving-and-footprint.md#stored-models-mapped-moved-into-huge-pages-only-where-that-is-quick-or-the-machine-idles-2026-12-06-late-morning
and benchmarks/history/source-notes.md#huge-pages-rates

So a stored model is memory-mapped (``weight_store.read_tensor_file``: the model can run at once, on the page
cache's pages), and :func:`move_into_huge_pages` then moves the mapping's pages, one huge page at a time, into
anonymous memory in huge pages at the same addresses (read the file into a fresh huge page, then ``mremap`` it over
the mapped range), on a background thread. Tensors that view the mapping stay valid throughout and see the same
bytes; once the move is done the process no longer reads the file. Until then it does, as a memory-mapping engine
always does: the store is replaced by renaming a new file over it, never rewritten in place, and a file cut short
under a running model stops its move (a model that then reads a page past the file's end gets SIGBUS, as with any
mapped file).

Where fresh huge pages are that slow, a move beside the model's first pass, beside torch's import or beside
decoding slows each of them, up to several-fold (a short run then takes longer than copying before the first token
did; same sections). So ``generate`` holds the moves (:func:`pause_huge_page_moves`) until its first token is out,
and where the moves find fresh huge pages slow (:data:`SLOW_SECONDS_PER_GB`) holds them for the rest of its run
(:func:`hold_slow_huge_page_moves`): it decodes from the mapped file, a little slower than from huge pages but from
the start. ``serve`` holds slow moves while it has requests and ``chat`` while it answers, so they run while those
wait.

This module does not import torch (the mapping starts before torch's import).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
from pathlib import Path

# Linux's madvise advice values Python's mmap module does not name (MADV_POPULATE_READ: Linux 5.14 and later).
MADV_POPULATE_READ = 22
MREMAP_MAYMOVE, MREMAP_FIXED = 1, 2
THP_SETTINGS = Path("/sys/kernel/mm/transparent_hugepage")

# Fresh huge pages are "slow" here when the moves so far took this long per GB (after SLOW_AFTER_BYTES moved): a
# bound between the rate of moves back to back and the rate where the host had taken the memory back, which lie
# about an order of magnitude apart:
# benchmarks/history/serving-and-footprint.md#stored-models-mapped-moved-into-huge-pages-only-where-that-is-quick-or-the-machine-idles-2026-12-06-late-morning
SLOW_SECONDS_PER_GB = 1.5
SLOW_AFTER_BYTES = 8 << 20

_moves_may_run = threading.Event()  # cleared by pause_huge_page_moves: every move waits before its next stretch
_moves_may_run.set()
# Cleared by hold_slow_huge_page_moves: so do moves once fresh pages proved slow.
_slow_moves_may_run = threading.Event()
_slow_moves_may_run.set()
_huge_pages_slow = threading.Event()  # set by the first move that finds them slow


def pause_huge_page_moves() -> None:
    """Hold every move into huge pages (:func:`move_into_huge_pages`) before its next huge page, until
    :func:`resume_huge_page_moves`: for work that should not share the machine with it (a command's first token)."""
    _moves_may_run.clear()


def resume_huge_page_moves() -> None:
    """Let the moves held by :func:`pause_huge_page_moves` go on."""
    _moves_may_run.set()


def hold_slow_huge_page_moves() -> None:
    """Where fresh huge pages have proved slow to get (:data:`SLOW_SECONDS_PER_GB`), hold the moves until
    :func:`release_slow_huge_page_moves`: while a command computes (``generate`` for its whole run; ``serve`` while
    it has requests), so that the seconds a move takes there come out of idle time, or never. Where they are quick
    the moves go on."""
    _slow_moves_may_run.clear()


def release_slow_huge_page_moves() -> None:
    """Let the moves held by :func:`hold_slow_huge_page_moves` go on."""
    _slow_moves_may_run.set()


def _wait_for_turn(stop: threading.Event | None) -> bool:
    """Wait until moves may run (:func:`pause_huge_page_moves`, :func:`hold_slow_huge_page_moves`); False when
    ``stop`` is set first."""
    while stop is None or not stop.is_set():
        if not _moves_may_run.is_set():
            _moves_may_run.wait(0.05)
        elif _huge_pages_slow.is_set() and not _slow_moves_may_run.is_set():
            _slow_moves_may_run.wait(0.05)
        else:
            return True
    return False


def anonymous_memory(nbytes: int) -> mmap.mmap:
    """``nbytes`` of zeroed, page-aligned, private process memory, in transparent huge pages where the system allows
    them (Linux ``madvise``). Private: Python's default for anonymous maps is shared (shmem) memory, where
    ``MADV_HUGEPAGE`` does nothing."""
    if hasattr(mmap, "MAP_PRIVATE"):
        data = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    else:
        data = mmap.mmap(-1, max(nbytes, 1))
    if hasattr(mmap, "MADV_HUGEPAGE"):
        data.madvise(mmap.MADV_HUGEPAGE)
    return data


def populate(mapping: mmap.mmap) -> None:
    """Fault in every page of ``mapping`` now (reading the file where the page cache lacks it), so that the model's
    first pass does not; with ``MADV_HUGEPAGE`` set first, Linux reads what is not cached in huge folios. Best
    effort: on systems without ``MADV_POPULATE_READ`` the pages fault in on first use."""
    advice = ([mmap.MADV_HUGEPAGE] if hasattr(mmap, "MADV_HUGEPAGE") else []) + \
        ([MADV_POPULATE_READ] if sys.platform == "linux" else [])
    for value in advice:
        try:
            mapping.madvise(value)
        except OSError:  # advice this kernel does not take (MADV_POPULATE_READ: before 5.14)
            pass


def huge_page_size() -> int | None:
    """The size of a transparent huge page where the system hands them out on request (Linux, ``enabled`` set to
    ``always`` or ``madvise``), else None."""
    try:
        enabled = (THP_SETTINGS / "enabled").read_text()
        size = int((THP_SETTINGS / "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return None
    return size if "[never]" not in enabled and size > 0 else None


class _Libc:
    """The C library's ``mmap``, ``munmap``, ``madvise`` and ``mremap`` (ctypes; each call releases the GIL)."""

    def __init__(self):
        libc = ctypes.CDLL(None, use_errno=True)
        self.mmap, self.munmap, self.madvise, self.mremap = libc.mmap, libc.munmap, libc.madvise, libc.mremap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self.mremap.restype = ctypes.c_void_p
        self.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]

    def fresh_pages(self, nbytes: int, align: int) -> int | None:
        """The address of ``nbytes`` of new private anonymous memory at a multiple of ``align``, advised into huge
        pages; None when the system refuses."""
        reserved = self.mmap(None, nbytes + align, mmap.PROT_READ | mmap.PROT_WRITE,
                             mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if reserved in (None, ctypes.c_void_p(-1).value):
            return None
        start = -(-reserved // align) * align
        if start > reserved:
            self.munmap(reserved, start - reserved)
        if reserved + align > start:
            self.munmap(start + nbytes, reserved + align - start)
        self.madvise(start, nbytes, mmap.MADV_HUGEPAGE)
        return start

    def move_over(self, source: int, nbytes: int, target: int) -> bool:
        """Move the pages at ``source`` over ``target`` (which they replace at once); False when refused."""
        return self.mremap(source, nbytes, nbytes, MREMAP_MAYMOVE | MREMAP_FIXED, target) == target


def move_into_huge_pages(mapping: mmap.mmap, fd: int, stop: threading.Event | None = None) -> int:
    """Move the pages of ``mapping`` (a private mapping of the file open as ``fd``) into private anonymous memory
    at the same addresses: each huge-page-aligned stretch is read from the file into a fresh huge page, which
    ``mremap`` then puts in place of the mapped range (a stretch shorter than a huge page, at the mapping's ends,
    into small pages the same way). Returns the bytes moved: all of the mapping; less where the file has been cut
    short under it (the move stops there: reading the file, not the mapping, it never faults on a page past the
    file's end); 0 where the system has no transparent huge pages or no ``mremap`` (not Linux). What is not moved
    stays mapped, as every page of a model is until its move.

    Readers of the mapping (the kernels, on other threads) see the same bytes before, during and after a move: the
    kernel swaps the pages under its mapping lock. ``stop`` set ends the move early (a mapping nobody took);
    :func:`pause_huge_page_moves` holds it between two stretches, and so does :func:`hold_slow_huge_page_moves` once
    the moves so far have found fresh huge pages slow.
    """
    page = huge_page_size()
    if page is None or mapping.closed or not hasattr(mmap, "MADV_HUGEPAGE"):
        return 0
    try:
        libc = _Libc()
    except (OSError, AttributeError, TypeError):  # not a C library with mremap
        return 0
    anchor = ctypes.c_char.from_buffer(mapping)  # an export: the mapping cannot be closed while it moves
    try:
        base, size = ctypes.addressof(anchor), len(mapping)
        end = base + -(-size // mmap.PAGESIZE) * mmap.PAGESIZE  # the mapping ends on a whole small page
        address, seconds = base, 0.0
        while address < end and _wait_for_turn(stop):
            started = time.perf_counter()
            stretch = min((address // page + 1) * page, end) - address
            fresh = libc.fresh_pages(stretch, page if stretch == page else mmap.PAGESIZE)
            if fresh is None:
                break
            wanted = min(stretch, base + size - address)
            if _read_into(fd, fresh, wanted, address - base) < wanted or not libc.move_over(fresh, stretch, address):
                libc.munmap(fresh, stretch)
                break
            address += stretch
            seconds += time.perf_counter() - started
            if address - base >= SLOW_AFTER_BYTES and seconds > SLOW_SECONDS_PER_GB * (address - base) / 1e9:
                _huge_pages_slow.set()
        return min(address - base, size)
    finally:
        del anchor


def _read_into(fd: int, address: int, nbytes: int, offset: int) -> int:
    """Read ``nbytes`` of the file ``fd`` from ``offset`` into memory at ``address``; the bytes read (fewer at the
    file's end)."""
    view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
    done = 0
    while done < nbytes:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            break
        done += got
    return done
