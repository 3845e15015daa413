"""KV offloading: the prefix cache's second tier, in host memory (--kv-offloading-size).

The first tier is the KV rows themselves (prefix_cache.py): a prefix stays matchable while
the row that computed it is not handed to another request, so the cache holds at most as
many prefixes as there are rows. With many adapters, each with its own system prompt, that
is too few. Here, when a row that holds a prefix is handed to another request, the prefix's
whole blocks that the store lacks are copied to host memory first (`save`), and an
admission whose prompt the store holds further than any row copies those blocks back into
its row (`load`) instead of prefilling them: host-to-device bytes instead of a prefill.

    rows (GPU):   row 2 holds [system A 64][question 20]      -> handed to a new request
    store (host): + extent 7: blocks of [system A 64] (4 blocks; the 20-token tail is no block)
    later, a prompt [system A 64][question 9] under A's key: no row holds it;
                  the store holds 64 tokens -> copied into the new row, 9 tokens prefilled

Blocks are the prefix cache's (BLOCK tokens, chained hashes: a block's hash covers every
token before it and the key, prefix_cache.chain_hashes), and the store keeps each block
once: a save adds only the blocks the store lacks, as one extent, contiguous in the store,
so that a load moves few contiguous runs. Host layout: [blocks, 2 (K, V), layers, kv_heads,
BLOCK, head_dim], page-locked on CUDA; a run goes through device staging of STAGE blocks
(one gather or scatter op over every layer, one copy across the bus). Gathers and scatters
are queued on the current stream, behind what was queued before them: a save's gather runs
before the prefill that overwrites its row, a load before the prefill that reads it. On CUDA
a save's copy to the host runs on a copy stream of its own, from a ring of SAVE_CHUNKS
staging chunks, so the prefill does not wait for it; it starts after everything queued
before the gather (so a block reused by a later save is overwritten after the loads queued
before it), and a load waits for the save of the blocks it reads.

Eviction: the least recently used extent (saved or matched) goes first, never one that the
admission in progress loads from. A chain broken by an evicted extent leaves the extents
after it unmatched; they age out in turn. A match checks each block's key, parent hash and
tokens, so a collision is a miss.
"""

from __future__ import annotations

import bisect
import logging
import math
import mmap
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from .kv_cache import KVCache
from .prefix_cache import BLOCK, RowPrefix, key_hash

log = logging.getLogger(__name__)

# Blocks moved per staging round trip (for Llama-3-8B in bf16: 32 MiB of device memory).
STAGE = 16
# On CUDA, saves go through a ring of this many staging chunks (STAGE blocks each; 256 MiB for
# Llama-3-8B in bf16): a chunk is gathered out of the row on the compute stream, then copied
# to host memory on a copy stream of its own, so the prefill that follows does not wait for
# the bus. A 1,024-token prefix of Llama-3-8B is 4 chunks: two such saves can be on their way
# at once before a third waits for the first.
SAVE_CHUNKS = 8


class _LockedPages(mmap.mmap):
    """Anonymous host pages, page-locked for CUDA (cudaHostRegister) while they are mapped:
    when the last view of them goes, they are unregistered before they are unmapped. Memory
    freed while still registered leaves the driver a registration of pages the process may
    map again (seen on the H200: the next cuBLAS handle made in the process failed)."""

    address = 0  # set once registered

    def __del__(self) -> None:
        if self.address:
            torch.cuda.cudart().cudaHostUnregister(self.address)
            self.address = 0


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Host memory of `shape`, page-locked (`pin`) so that copies to and from the device run
    asynchronously: pages of its own, registered in place (cudaHostRegister) and unregistered
    when the tensor and its views are gone (_LockedPages), not taken from torch's pinned
    allocator, which rounds a request up to a power of two (40 GiB asked, 64 GiB locked).
    Where it cannot be locked, plain memory: the copies then wait for the device."""
    numel = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not (pin and numel):
        return torch.empty(shape, dtype=dtype)
    pages = _LockedPages(-1, numel * itemsize)
    t = torch.frombuffer(pages, dtype=dtype).view(shape)  # the tensor's storage holds `pages`
    err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), numel * itemsize, 0)
    if int(err) != 0:
        log.warning("KV offloading: could not page-lock %.1f GB of host memory (%s); its copies will "
                    "wait for the device", numel * itemsize / 1e9, err)
    else:
        pages.address = t.data_ptr()
    return t


@dataclass
class Extent:
    """Blocks start..start+len(hashes)-1 of the store: a prefix's blocks first..first+n-1
    under `key`, computed after the chain hash `parent`."""

    start: int
    key: Hashable
    parent: int
    hashes: list[int]
    tokens: list[int]  # the blocks' tokens, BLOCK each
    used: int = 0


class HostPrefixStore:
    def __init__(self, kv: KVCache, size_bytes: int, pin: bool | None = None):
        self.kv = kv
        layers, _, kv_heads, _, head_dim = kv.k_all.shape
        self.block_shape = (2, layers, kv_heads, BLOCK, head_dim)
        self.block_bytes = self.bytes_per_block(kv)
        self.num_blocks = int(size_bytes // self.block_bytes)
        if self.num_blocks < 1:
            raise ValueError(f"--kv-offloading-size holds no block of {BLOCK} tokens ({self.block_bytes} bytes)")
        device = kv.k_all.device
        pin = device.type == "cuda" if pin is None else pin
        self.data = host_buffer((self.num_blocks, *self.block_shape), kv.k_all.dtype, pin)
        self._stage: torch.Tensor | None = None  # device staging of loads, made at first use
        self._async_saves = device.type == "cuda" and self.data.is_pinned()
        # Saves on CUDA (_save_async): the ring, the copy stream, per ring chunk the event its
        # last copy to the host records, and the saves whose copies may still be on their way
        # (store blocks start..end-1, the event of their last chunk), which a load waits for.
        self._ring: torch.Tensor | None = None
        self._copier: torch.cuda.Stream | None = None
        self._chunk_done: list[torch.cuda.Event | None] = [None] * SAVE_CHUNKS
        self._next_chunk = 0
        self._in_flight: list[tuple[int, int, torch.cuda.Event]] = []
        self._extents: dict[int, Extent] = {}  # start block -> extent
        self._index: dict[int, tuple[Extent, int]] = {}  # chain hash -> (extent, block within it)
        self._free: list[tuple[int, int]] = []  # (start, length), sorted, coalesced
        self._clock = 0
        # Tokens copied back from the store into rows (what a prefill did not compute), and saved.
        self.loaded_tokens = self.saved_tokens = 0
        self.clear()

    def clear(self) -> None:
        """Forget every block (the memory stays), and the counts."""
        self._extents.clear()
        self._index.clear()
        self._free = [(0, self.num_blocks)]
        self.loaded_tokens = self.saved_tokens = 0

    @staticmethod
    def bytes_per_block(kv: KVCache) -> int:
        """Host bytes of one block: BLOCK tokens' K and V over every layer."""
        layers, _, kv_heads, _, head_dim = kv.k_all.shape
        return 2 * layers * kv_heads * BLOCK * head_dim * kv.k_all.element_size()

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    @property
    def blocks_used(self) -> int:
        return sum(len(e.hashes) for e in self._extents.values())

    # -- lookups ---------------------------------------------------------------------------

    def match(self, key: Hashable, tokens: list[int], limit: int, touch: bool = True) -> list[int]:
        """The store blocks holding tokens[:n] under `key`, n a whole number of blocks <= limit,
        as long as the store has them in a chain from the first; they count as used now unless
        not `touch` (a look that admits nothing)."""
        blocks, h = [], key_hash(key)
        for lo in range(0, min(limit, len(tokens)) - BLOCK + 1, BLOCK):
            block = tokens[lo: lo + BLOCK]
            nxt = hash((h, tuple(block)))
            hit = self._index.get(nxt)
            if hit is None:
                break
            extent, i = hit
            parent = extent.parent if i == 0 else extent.hashes[i - 1]
            if extent.key != key or parent != h or extent.tokens[i * BLOCK: (i + 1) * BLOCK] != block:
                break  # a collision
            blocks.append(extent.start + i)
            if touch:
                extent.used = self._tick()
            h = nxt
        return blocks

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    # -- moves -----------------------------------------------------------------------------

    def save(self, row: int, prefix: RowPrefix, keep: list[int] = ()) -> int:
        """Copy the whole blocks of `prefix` (what KV row `row` holds) that the store lacks into
        one new extent, evicting the least recently used extents (none holding a block of
        `keep`, nor of the prefix's blocks before those) to make room; as many of them as fit,
        from the first missing one on. Returns the tokens saved."""
        hashes = prefix.hashes
        first = next((i for i, h in enumerate(hashes) if h not in self._index), len(hashes))
        missing = len(hashes) - first
        if missing == 0:
            return 0
        # The blocks before them stay too: without them the new ones would be out of reach.
        held = {self._index[h][0].start + self._index[h][1] for h in hashes[:first]}
        start, n = self._allocate(missing, set(keep) | held)
        if n == 0:
            return 0
        parent = hashes[first - 1] if first else key_hash(prefix.key)
        extent = Extent(start, prefix.key, parent, list(hashes[first: first + n]),
                        list(prefix.tokens[first * BLOCK: (first + n) * BLOCK]), self._tick())
        self._extents[start] = extent
        for i, h in enumerate(extent.hashes):
            self._index[h] = (extent, i)
        done = self._copy(row, first, start, n, to_store=True)
        if done is not None:
            self._in_flight = [f for f in self._in_flight if not f[2].query()] + [(start, start + n, done)]
        self.saved_tokens += n * BLOCK
        return n * BLOCK

    def load(self, row: int, blocks: list[int]) -> int:
        """Copy store `blocks` (a `match`) into KV row `row` at positions 0.. ; returns the tokens."""
        if self._in_flight:
            # The copies of saves to these blocks may still be on their way (_save_async).
            compute = torch.cuda.current_stream(self.kv.k_all.device)
            left = []
            for f in self._in_flight:
                if any(f[0] <= b < f[1] for b in blocks):
                    compute.wait_event(f[2])  # what the compute stream runs from now on comes after it
                else:
                    left.append(f)
            self._in_flight = left
        i = 0
        while i < len(blocks):
            j = i + 1
            while j < len(blocks) and blocks[j] == blocks[j - 1] + 1:
                j += 1
            self._copy(row, i, blocks[i], j - i, to_store=False)
            i = j
        self.loaded_tokens += len(blocks) * BLOCK
        return len(blocks) * BLOCK

    def _row_blocks(self, row: int, first: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of blocks first..first+m-1 of KV row `row`, each as [m, layers, kv_heads,
        BLOCK, d] views of the cache."""
        k_all = self.kv.k_all
        layers, kv_heads, head_dim = k_all.shape[0], k_all.shape[2], k_all.shape[4]
        lo, hi = first * BLOCK, (first + m) * BLOCK
        return tuple(cache[:, row, :, lo:hi].view(layers, kv_heads, m, BLOCK, head_dim).permute(2, 0, 1, 3, 4)
                     for cache in (k_all, self.kv.v_all))

    def _copy(self, row: int, first: int, start: int, n: int, to_store: bool):
        """Blocks first..first+n-1 of KV row `row` to (or from) store blocks start..start+n-1,
        STAGE blocks a round trip through device staging. A save on CUDA returns the event its
        copy to the host records (_save_async)."""
        if to_store and self._async_saves:
            return self._save_async(row, first, start, n)
        if self._stage is None:
            k_all = self.kv.k_all
            self._stage = torch.empty((STAGE, *self.block_shape), dtype=k_all.dtype, device=k_all.device)
        for off in range(0, n, STAGE):
            m = min(STAGE, n - off)
            stage = self._stage[:m]
            host = self.data[start + off: start + off + m]
            for part, rows in enumerate(self._row_blocks(row, first + off, m)):
                if to_store:
                    stage[:, part].copy_(rows)
                else:
                    if part == 0:
                        stage.copy_(host, non_blocking=True)
                    rows.copy_(stage[:, part])
            if to_store:
                host.copy_(stage, non_blocking=True)

    def _save_async(self, row: int, first: int, start: int, n: int) -> torch.cuda.Event:
        """`_copy` to the store on CUDA: each chunk gathered into the next chunk of the ring on
        the compute stream (behind what was queued before: the row's last writes, and any
        load from the store blocks it overwrites), then copied to the host on the copy stream.
        The compute stream waits only for a ring chunk's copy before it gathers into it again;
        a load of the extent, for the event returned (its last chunk's, in stream order)."""
        k_all = self.kv.k_all
        compute = torch.cuda.current_stream(k_all.device)
        if self._ring is None:
            self._ring = torch.empty((SAVE_CHUNKS, STAGE, *self.block_shape), dtype=k_all.dtype, device=k_all.device)
            self._copier = torch.cuda.Stream(k_all.device)
        for off in range(0, n, STAGE):
            m = min(STAGE, n - off)
            j = self._next_chunk
            self._next_chunk = (j + 1) % SAVE_CHUNKS
            if self._chunk_done[j] is not None:
                compute.wait_event(self._chunk_done[j])
            chunk = self._ring[j, :m]
            for part, rows in enumerate(self._row_blocks(row, first + off, m)):
                chunk[:, part].copy_(rows)
            gathered = torch.cuda.Event()
            gathered.record(compute)
            self._copier.wait_event(gathered)
            with torch.cuda.stream(self._copier):
                self.data[start + off: start + off + m].copy_(chunk, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._copier)
            self._chunk_done[j] = done
        return done

    # -- space -----------------------------------------------------------------------------

    def _allocate(self, n: int, keep: set[int]) -> tuple[int, int]:
        """(start, count): a free run of n blocks (fewer when the store cannot make n free
        without evicting a block of `keep`), the least recently used extents evicted for it."""
        n = min(n, self.num_blocks)
        while True:
            run = next(((s, length) for s, length in self._free if length >= n), None)
            if run is not None:
                self._take(run[0], n)
                return run[0], n
            victims = sorted((e for e in self._extents.values()
                              if not any(e.start <= b < e.start + len(e.hashes) for b in keep)),
                             key=lambda e: e.used)
            if not victims:
                best = max(self._free, key=lambda r: r[1], default=(0, 0))
                if best[1] == 0:
                    return 0, 0
                self._take(best[0], best[1])
                return best
            self._evict(victims[0])

    def _take(self, start: int, n: int) -> None:
        i = next(i for i, (s, _) in enumerate(self._free) if s == start)
        s, length = self._free[i]
        if length == n:
            del self._free[i]
        else:
            self._free[i] = (s + n, length - n)

    def _evict(self, extent: Extent) -> None:
        del self._extents[extent.start]
        for h in extent.hashes:
            if self._index.get(h, (None,))[0] is extent:
                del self._index[h]
        start, end = extent.start, extent.start + len(extent.hashes)
        i = bisect.bisect_left(self._free, (start, 0))
        self._free.insert(i, (start, end - start))
        # Coalesce with the runs on either side.
        if i + 1 < len(self._free) and self._free[i + 1][0] == end:
            self._free[i] = (start, end - start + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
            ps, pl = self._free[i - 1]
            self._free[i - 1] = (ps, pl + self._free[i][1])
            del self._free[i]
