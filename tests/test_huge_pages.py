"""A mapped file's pages move into anonymous memory at the same addresses, readers see the same bytes throughout, and
afterwards the process no longer reads the file (``loading/huge_pages.py``)."""

from __future__ import annotations

import mmap
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from sparsespec.loading import huge_pages
from sparsespec.loading.huge_pages import (
    huge_page_size,
    move_into_huge_pages,
    pause_huge_page_moves,
    resume_huge_page_moves,
)

pytestmark = pytest.mark.skipif(huge_page_size() is None, reason="no transparent huge pages (Linux only)")


def mapped_pages(start: int, stop: int) -> dict[str, int]:
    """Of this process's mappings in ``[start, stop)``: KiB resident from files and anonymous, and the anonymous
    KiB in huge pages (``/proc/self/smaps``)."""
    totals = {"file": 0, "anonymous": 0, "huge": 0}
    inside = False
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and fields[0][0] in "0123456789abcdef" and ":" not in fields[0]:
            low, high = (int(x, 16) for x in fields[0].split("-"))
            inside = low < stop and high > start
            file_backed = fields[4] != "0"
        elif inside and fields[0] == "Rss:":
            totals["file" if file_backed else "anonymous"] += int(fields[1])
        elif inside and fields[0] == "AnonHugePages:":
            totals["huge"] += int(fields[1])
    return totals


@dataclass
class MappedFile:
    path: Path
    data: bytes  # what the file held when it was mapped
    mapping: mmap.mmap
    fd: int

    @property
    def view(self) -> np.ndarray:
        return np.frombuffer(self.mapping, dtype=np.uint8)


@pytest.fixture
def mapped_file(tmp_path):
    """``mapped_file(size)``: a file of ``size`` random bytes, a private mapping of it and a descriptor of it (closed
    when the test ends), as ``weight_store.read_tensor_file`` holds them."""
    descriptors = []

    def make(size: int) -> MappedFile:
        path = tmp_path / f"weights{len(descriptors)}.bin"
        data = np.random.default_rng(len(descriptors)).integers(0, 256, size, dtype=np.uint8).tobytes()
        path.write_bytes(data)
        with open(path, "rb") as f:
            descriptors.append(os.dup(f.fileno()))
            return MappedFile(path, data, mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE), descriptors[-1])

    yield make
    for fd in descriptors:
        os.close(fd)


@pytest.mark.parametrize("huge_pages", [0, 3])
def test_a_mapped_file_moves_into_anonymous_memory_and_leaves_the_file(mapped_file, huge_pages):
    """Every byte of the mapping moves (a file shorter than a huge page too, into small pages); the bytes are the
    file's; the range holds no file pages afterwards, and truncating the file no longer changes what it reads."""
    size = huge_pages * huge_page_size() + 12_345
    file = mapped_file(size)
    start = file.view.ctypes.data
    assert file.view.tobytes() == file.data and mapped_pages(start, start + size)["file"] > 0  # faulted in

    assert move_into_huge_pages(file.mapping, file.fd) == size

    pages = mapped_pages(start, start + size)
    assert pages["file"] == 0 and pages["anonymous"] * 1024 >= size
    file.path.write_bytes(b"")  # the file gone: a read of a still-mapped page would fault
    assert file.view.tobytes() == file.data
    if huge_pages:
        print(f"anonymous huge pages: {pages['huge']} KiB of {size // 1024} KiB")


def test_readers_see_the_same_bytes_while_the_pages_move(mapped_file):
    """A thread summing the mapping over and over while it moves gets the file's sum every time."""
    size = 8 * huge_page_size()
    file = mapped_file(size)
    expected = int(np.frombuffer(file.data, dtype=np.uint8).sum(dtype=np.uint64))
    sums, moving = [], threading.Event()
    moving.set()

    def read_while_moving():
        while moving.is_set() or not sums:
            sums.append(int(file.view.sum(dtype=np.uint64)))

    reader = threading.Thread(target=read_while_moving)
    reader.start()
    try:
        moved = move_into_huge_pages(file.mapping, file.fd)
    finally:
        moving.clear()
        reader.join()
    assert moved == size
    assert sums and all(s == expected for s in sums)
    assert mapped_pages(file.view.ctypes.data, file.view.ctypes.data + size)["file"] == 0


def test_a_stopped_move_leaves_the_rest_mapped(mapped_file):
    """``stop`` set: nothing moves, and the mapping still reads the file."""
    size = 2 * huge_page_size()
    file = mapped_file(size)
    stop = threading.Event()
    stop.set()
    assert move_into_huge_pages(file.mapping, file.fd, stop) == 0
    assert file.view.tobytes() == file.data
    assert mapped_pages(file.view.ctypes.data, file.view.ctypes.data + size)["anonymous"] == 0


def test_a_paused_move_waits_for_resume(mapped_file):
    """With the moves paused, a move started takes no page until they are resumed; then it moves them all."""
    size = 2 * huge_page_size()
    file = mapped_file(size)
    moved = []
    pause_huge_page_moves()
    try:
        mover = threading.Thread(target=lambda: moved.append(move_into_huge_pages(file.mapping, file.fd)))
        mover.start()
        mover.join(timeout=0.5)
        assert mover.is_alive() and not moved
        assert mapped_pages(file.view.ctypes.data, file.view.ctypes.data + size)["anonymous"] == 0
    finally:
        resume_huge_page_moves()
    mover.join()
    assert moved == [size] and file.view.tobytes() == file.data


def test_a_file_cut_short_under_a_move_stops_it_without_a_fault(mapped_file):
    """The move reads the file, not the mapping: a file truncated under it ends the move at the cut, with the
    pages before it moved and nothing read past the file's end (no SIGBUS)."""
    page = huge_page_size()
    file = mapped_file(3 * page)
    os.truncate(file.path, page + 100)
    assert move_into_huge_pages(file.mapping, file.fd) == page
    assert file.view[:page].tobytes() == file.data[:page]


def test_held_slow_moves_wait_once_fresh_pages_prove_slow(mapped_file, monkeypatch):
    """With slow moves held, a move goes on while fresh huge pages are quick, and waits once it has found them slow
    (here: any speed counts as slow), until released; a stop ends the wait."""
    page = huge_page_size()
    size = 8 * page
    file = mapped_file(size)
    monkeypatch.setattr(huge_pages, "SLOW_SECONDS_PER_GB", 0.0)
    monkeypatch.setattr(huge_pages, "SLOW_AFTER_BYTES", 2 * page)
    monkeypatch.setattr(huge_pages, "_huge_pages_slow", threading.Event())
    moved = []
    huge_pages.hold_slow_huge_page_moves()
    try:
        mover = threading.Thread(target=lambda: moved.append(move_into_huge_pages(file.mapping, file.fd)))
        mover.start()
        mover.join(timeout=1.0)
        assert mover.is_alive() and huge_pages._huge_pages_slow.is_set()
        pages = mapped_pages(file.view.ctypes.data, file.view.ctypes.data + size)
        assert pages["anonymous"] * 1024 == 2 * page  # it stopped where it found them slow
    finally:
        huge_pages.release_slow_huge_page_moves()
    mover.join()
    assert moved == [size] and file.view.tobytes() == file.data

    second = mapped_file(size)
    huge_pages.hold_slow_huge_page_moves()
    try:
        stop = threading.Event()
        mover = threading.Thread(target=lambda: moved.append(move_into_huge_pages(second.mapping, second.fd, stop)))
        mover.start()
        mover.join(timeout=0.5)
        stop.set()
        mover.join(timeout=5)
        assert not mover.is_alive() and moved[-1] == 0  # slow already: it waited from the start, then stopped
    finally:
        huge_pages.release_slow_huge_page_moves()
