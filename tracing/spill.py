"""A big log's index kept on disk (issue #17): the index's columns appended to nameless temporary files in the
project's cache (model/config.py `cache_dir()`, folder `index/`) while the scan runs, then mapped read-only, so
that the index of a 1 GB log of 250M events costs disk and page cache, not the process's memory.

    spill = Spill("run.mdt")              # SpillError (a TraceError, one sentence) if the cache is not writable
    col = spill.column(np.int32)
    col.append(piece)                     # write(2): SpillError if the disk fills up
    a = col.array()                       # a read-only ndarray over the file's mapping
    for lo, block in blocks(a): ...       # a whole-column pass; each block's pages handed back after use
    take(a, positions)                    # a gather, likewise

The files have no name (O_TMPFILE, or unlinked at once where the file system lacks it), so none is ever left
behind, whatever ends the process: the kernel frees one when its last mapping and descriptor are gone (the
arrays over it dropped, or `Spill.close`). Pages written go through write(2), never through a mapping, so they
are not resident in the process; pages read through a mapping are (RSS and VmHWM count them) until handed
back, which is why every pass over a whole mapped column goes through `blocks` or `take` (madvise
MADV_DONTNEED; the page cache keeps them, a later read maps them again). On arrays in memory both are plain
numpy, so the index runs one code path either way.

`groups` sorts a mapped int32 column into a CSR (tracing/index.py `_Groups`) with bounded memory: a histogram of
its values splits them into ranges of at most GROUP_KEYS positions each (a value held more often is a range of
its own, whose positions are simply listed), and each range is sorted in memory as index.py sorts a whole
column, one pass over the column per range.
"""
from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from tracing.reader import TraceError

BLOCK = 1 << 20            # elements of a column read at a time (4-8 MiB of int32-int64)
GROUP_KEYS = 1 << 23       # positions sorted in memory at a time by `groups` (64 MiB of int64 keys)


class SpillError(TraceError):
    """The cache cannot hold a spilled index (not writable, or the disk filled up): one sentence."""


def spill_folder() -> Path:
    """cache_dir()/index: the project's cache (model/config.py, torch-free), imported only when a spill is planned,
    so that indexing a log in memory loads no module of model/."""
    from model.config import cache_dir
    return cache_dir() / "index"


def disk_free() -> int | None:
    """Free bytes on the file system the spill folder is (or would be) on; None if unknown."""
    folder = spill_folder()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


class Spill:
    """The files of one log's spilled index (`what`: the log, for the messages)."""

    def __init__(self, what):
        self.what, self.folder, self.columns = what, spill_folder(), []
        try:
            self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        except OSError as e:
            raise self.error(e) from None

    def column(self, dtype) -> Column:
        try:
            column = Column(self, tempfile.TemporaryFile(dir=self.folder, buffering=0), dtype)
        except OSError as e:
            raise self.error(e) from None
        self.columns.append(column)
        return column

    def error(self, e: OSError) -> SpillError:
        return SpillError(f"the index of {self.what} could not be written to {self.folder} ({e.strerror or e}): free "
                          f"some disk space there, or set MDI_CACHE to a writable folder with more room.")

    def close(self) -> None:
        """Close every file not yet mapped; a mapped one goes with the last array over it."""
        for column in self.columns:
            column.file.close()
        self.columns = []


class Column:
    """One column appended to a nameless file, `list.append`'s way; `array()` maps what was written."""

    def __init__(self, spill: Spill, file, dtype):
        self.spill, self.file, self.dtype, self.n = spill, file, np.dtype(dtype), 0

    def __len__(self) -> int:
        return self.n

    def append(self, piece) -> None:
        data = np.ascontiguousarray(piece, self.dtype)
        view = memoryview(data.view(np.uint8))
        try:
            while len(view):
                view = view[os.write(self.file.fileno(), view):]
        except OSError as e:
            raise self.spill.error(e) from None
        self.n += len(data)

    def array(self) -> np.ndarray:
        """What was written, as a read-only array over the file's mapping (the file's descriptor is closed)."""
        try:
            if not self.n:
                return np.zeros(0, self.dtype)
            return np.frombuffer(mmap.mmap(self.file.fileno(), self.n * self.dtype.itemsize, access=mmap.ACCESS_READ),
                                 self.dtype)
        except OSError as e:
            raise self.spill.error(e) from None
        finally:
            self.file.close()


def mapped(a) -> mmap.mmap | None:
    """The file mapping an array is a view of, if any."""
    base = a
    while isinstance(base, np.ndarray):
        base = base.base
    base = base.obj if isinstance(base, memoryview) else base
    return base if isinstance(base, mmap.mmap) else None


def release(a: np.ndarray) -> None:
    """Hand the pages of a view of a mapped array back to the kernel; nothing for an array in memory."""
    mm = mapped(a)
    if mm is None or not a.size or not hasattr(mmap, "MADV_DONTNEED"):
        return
    try:
        lo, hi = np.lib.array_utils.byte_bounds(a)
        start = lo - np.frombuffer(mm, np.uint8).ctypes.data
        start -= start % mmap.PAGESIZE
        mm.madvise(mmap.MADV_DONTNEED, start, min(hi - lo + mmap.PAGESIZE, len(mm) - start))
    except (OSError, ValueError):
        pass


def blocks(a: np.ndarray, size: int | None = None):
    """(start, a[start:start + size]) over the whole array (size: BLOCK); each block's pages are handed back
    once used."""
    size = size or BLOCK
    for lo in range(0, len(a), size):
        block = a[lo:lo + size]
        yield lo, block
        release(block)


def blocks_of(*arrays: np.ndarray, size: int | None = None):
    """(start, [a[start:start + size] for a in arrays]) over arrays of one length, handed back likewise."""
    size = size or BLOCK
    for lo in range(0, len(arrays[0]), size):
        views = [a[lo:lo + size] for a in arrays]
        yield lo, views
        for view in views:
            release(view)


def take(a: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """a[positions], the pages read handed back block by block (each block's span of positions: the fewer pages
    the more ascending they are)."""
    if mapped(a) is None:
        return a[positions]
    out = np.empty(len(positions), a.dtype)
    for lo, pos in blocks(positions):
        out[lo:lo + len(pos)] = a[pos]
        release(a[pos.min():pos.max() + 1])
    return out


def flatnonzero(a: np.ndarray, test, sink=None) -> np.ndarray:
    """np.flatnonzero(test(a)), block by block (`test` maps a block to a mask); into `sink` (a Column) if given."""
    pieces = [] if sink is None else sink
    for lo, block in blocks(a):
        pieces.append(np.flatnonzero(test(block)) + lo)
    if sink is not None:
        return sink.array()
    return np.concatenate(pieces) if pieces else np.zeros(0, np.intp)


def groups(column: np.ndarray, spill: Spill) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(order int32, values, starts int64) of an int32 column, as index.py's `_Groups` builds them, written to
    `spill`'s files with bounded memory (see the module docstring): the keys of one range at a time, 8 bytes each."""
    order, values, starts = spill.column(np.int32), spill.column(column.dtype), spill.column(np.int64)
    for lo, hi, count in _ranges(column):
        if lo == hi:   # one value: its positions, in order
            values.append([lo])
            starts.append([len(order)])
            for a, block in blocks(column):
                order.append(np.flatnonzero(block == lo) + a)
            continue
        key, filled = np.empty(count, np.int64), 0     # (value - lo) << 32 | position, sorted in place
        for a, block in blocks(column):
            pos = np.flatnonzero((block >= lo) & (block <= hi))
            part = key[filled:filled + len(pos)]
            part[:] = block[pos]
            part -= lo
            part <<= 32
            part |= pos + a
            filled += len(pos)
        key.sort()
        for a in range(0, count, BLOCK):   # where each value starts; then the positions, a block at a time
            high = key[max(a - 1, 0):a + BLOCK] >> 32
            new = np.flatnonzero(high[1:] != high[:-1]) + (max(a - 1, 0) + 1)
            first = np.concatenate([[0], new]) if a == 0 else new
            values.append((key[first] >> 32) + lo)
            starts.append(first + len(order))
        for a in range(0, count, BLOCK):
            order.append(key[a:a + BLOCK] & 0xFFFFFFFF)
        del key
    starts.append([len(order)])
    return order.array(), values.array(), starts.array()


def _ranges(column: np.ndarray) -> list[tuple[int, int, int]]:
    """Value ranges (lo, hi, positions held) in ascending order, together covering the column, each held by at
    most GROUP_KEYS positions or a single value: the greedy packing of a histogram of the top 16 bits of the
    values, and of the low 16 bits within a top value held more often than that."""
    low = np.iinfo(np.int32).min

    def histogram(select) -> np.ndarray:
        counts = np.zeros(1 << 16, np.int64)
        for _, block in blocks(column):
            counts += np.bincount(select(block.astype(np.int64) - low), minlength=1 << 16)   # 0 .. 2**32 - 1
        return counts

    def pack(counts: np.ndarray, base: int, width: int, out: list, heavy) -> None:
        start, end, held = None, None, 0
        for k in np.flatnonzero(counts).tolist():
            n = int(counts[k])
            if start is not None and held + n > GROUP_KEYS:
                out.append((start, end, held))
                start, held = None, 0
            if n > GROUP_KEYS and heavy is not None:
                heavy(base + k * width, out)
                continue
            start = base + k * width if start is None else start
            end, held = base + k * width + width - 1, held + n
        if start is not None:
            out.append((start, end, held))

    def split(top: int, out: list) -> None:   # one top value: its 2**16 values, each a range if need be
        pack(histogram(lambda u: u[(u >> 16) == (top - low) >> 16] & 0xFFFF), top, 1, out, None)

    ranges: list[tuple[int, int, int]] = []
    pack(histogram(lambda u: u >> 16), low, 1 << 16, ranges, split)
    return ranges
