"""Prefix caching: a prompt starts where a KV row already holds its first tokens.

Every KV row remembers the tokens its K/V holds (`RowPrefix`: who computed them, and the
token ids), a running request's row and a finished one's alike, until the row is handed to
another request. Admission (`admit`) matches the new prompt against them: the longest
prefix of it that a row of the same adapter holds, found by whole blocks of BLOCK tokens
through a hash index and then extended token by token on that row. Those positions are
copied into the new request's row and its prefill starts after them. The row it gets is
the free row that holds nothing, or else the one whose prefix was used least recently (a
finished chat turn stays for the next one while other rows are free), the donor last.

    row 3 (free): adapter sql, [system prompt 40][question A 12][answer A 30]
    a new request, adapter sql: [system prompt 40][question B 9]
      -> blocks 0-1 (32 tokens) found in row 3 by hash, 8 more by comparing: 40 tokens
      -> it gets row 0 (free, holding nothing); row 3's positions 0..39 are copied into
         row 0; its prefill computes 9 tokens at positions 40..48; row 3 keeps all it held

K/V depend on the adapter: LoRA on any projection changes every later layer's inputs, so
a row matches only prompts of the same `key` (LLMEngine.prefix_key): what identifies the
weights in the request's adapter slot (the files they were read from, so an adapter paged
out and back in, into any slot, finds its prefixes; another adapter or a new version is
another key), or the base.
A hash only finds a candidate: the tokens themselves are compared, so a collision is a miss,
never a wrong answer.

A row keeps its prefix until it is handed to another request. With a store (the host tier,
--kv-offloading-size: prefix_store.py), the prefix goes there first, and an admission that
the store holds further than any row takes its blocks from there.

What keeps a free row's K/V intact: no prefill writes a row it was not given, and a decode
step writes a free row inside its span (which computes garbage, kv_cache.py) at position
`KVCache.kept[row]`, just past what the row holds (DecodeRunner.run). A row's prefix is at
most max_len - 1 tokens: a row held but not decoded (mid chunked prefill) is written at the
last position.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from .kv_cache import KVCache

BLOCK = 16  # tokens per hashed block (vLLM's default block size); a hit is at least one block


@dataclass
class RowPrefix:
    """The tokens whose K/V a row holds at positions 0..len(tokens)-1, computed under `key`,
    and the chain hash of each of its whole blocks (hashes[i] covers tokens[:(i+1)*BLOCK])."""

    key: Hashable
    tokens: list[int]
    hashes: list[int] = field(default_factory=list)
    used: int = 0  # when it was last written or matched (PrefixCache's count of those)


def key_hash(key: Hashable) -> int:
    """What the chain of a prefix's block hashes starts from: its key's."""
    return hash(("loraplex-prefix", key))


def chain_hashes(key: Hashable, tokens: list[int], start: int = 0, seed: int | None = None) -> list[int]:
    """The chain hashes of blocks start.. of `tokens` (whole blocks only), `seed` the hash of
    block start - 1: each hashes the one before it (or the key) with its own tokens, so equal
    hashes mean equal prefixes, short of a collision."""
    h = key_hash(key) if seed is None else seed
    out = []
    for lo in range(start * BLOCK, len(tokens) - BLOCK + 1, BLOCK):
        h = hash((h, tuple(tokens[lo: lo + BLOCK])))
        out.append(h)
    return out


class PrefixCache:
    """Which prefix each KV row of `kv` holds, and the hash index over their blocks. Used
    on the engine's thread only (admission, the end of a prefill, a request's end)."""

    def __init__(self, kv: KVCache, store=None):
        """`store`: a prefix_store.HostPrefixStore, the second tier (None: rows only)."""
        self.kv = kv
        self.store = store
        self.rows: dict[int, RowPrefix] = {}
        self._index: dict[int, set[int]] = {}  # chain hash -> rows holding that prefix
        # Prompt tokens asked for and found, as vLLM's vllm:prefix_cache_queries / _hits count.
        self.queries = 0
        self.hits = 0
        self._clock = 0

    def match(self, key: Hashable, tokens: list[int], limit: int, touch: bool = True) -> tuple[int, int]:
        """(row, n): a row holding tokens[:n] computed under `key`, n <= limit as long as any
        row's is, at least one block; (-1, 0) when none is. Of the rows of the longest
        whole-block match, the one that holds the most tokens past it (each row is extended
        token by token, less than a block), the most recently used of those; it counts as
        used now unless not `touch` (a look that admits nothing)."""
        found: set[int] = set()
        depth = 0  # whole blocks found
        h = key_hash(key)
        for lo in range(0, min(limit, len(tokens)) - BLOCK + 1, BLOCK):
            h = hash((h, tuple(tokens[lo: lo + BLOCK])))
            rows = self._index.get(h)
            if not rows:
                break
            found, depth = rows, depth + 1
        # Each row's tokens past the whole blocks (fewer than a block), then the best row's
        # blocks compared whole: once, short of a collision (the rows of one chain hash hold
        # the same blocks; a burst's 32 rows of one system prompt need not all be compared).
        head = depth * BLOCK
        ranked = []
        for row in found:
            held = self.rows[row]
            n, end = head, min(limit, len(held.tokens), len(tokens))
            while n < end and held.tokens[n] == tokens[n]:
                n += 1
            ranked.append((n, held.used, row))
        for n, _, row in sorted(ranked, reverse=True):
            held = self.rows[row]
            if held.key == key and held.tokens[:head] == tokens[:head]:  # else a hash collision
                if touch:
                    held.used = self._touch()
                return row, n
        return -1, 0

    def found(self, key: Hashable, tokens: list[int], limit: int) -> int:
        """How many of `tokens` an admission would find now, in a row or in the store (a
        look: nothing counts as used)."""
        n = self.match(key, tokens, limit, touch=False)[1]
        if self.store is not None:
            n = max(n, BLOCK * len(self.store.match(key, tokens, limit, touch=False)))
        return n

    def _touch(self) -> int:
        self._clock += 1
        return self._clock

    def keep(self, row: int, key: Hashable, tokens: list[int]) -> None:
        """Row `row`'s K/V now holds `tokens` (computed under `key`), at most max_len - 1 of
        them. A row that held a prefix of them under the same key keeps its blocks' hashes."""
        tokens = tokens[: self.kv.max_len - 1]
        old = self.rows.get(row)
        if old is not None and old.key == key and len(old.tokens) <= len(tokens) and \
                tokens[: len(old.tokens)] == old.tokens:
            start = len(old.hashes)
            new = chain_hashes(key, tokens, start, old.hashes[-1] if old.hashes else None)
            old.tokens = list(tokens)
            old.hashes += new
            old.used = self._touch()
            for h in new:
                self._index.setdefault(h, set()).add(row)
        else:
            self.forget(row)
            hashes = chain_hashes(key, tokens)
            self.rows[row] = RowPrefix(key, list(tokens), hashes, self._touch())
            for h in hashes:
                self._index.setdefault(h, set()).add(row)
        self.kv.kept[row] = len(tokens)

    def forget(self, row: int) -> None:
        """Row `row` holds nothing anyone may match (it is about to be written)."""
        old = self.rows.pop(row, None)
        if old is not None:
            for h in old.hashes:
                rows = self._index[h]
                rows.discard(row)
                if not rows:
                    del self._index[h]
        self.kv.kept[row] = 0

    def admit(self, key: Hashable, tokens: list[int], match: bool = True) -> tuple[int, int]:
        """A KV row for a new request of `tokens` under `key`, and how many of its first tokens
        that row holds now: the longest prefix another row holds (or, longer, the store:
        prefix_store.py), copied in, at most all but the last token (whose logits the prefill
        must compute). With a store, the prefix the row given held goes to the store first.
        `match` False (a prompt whose every token's logprob is asked for): no match, the row
        only."""
        donor, n, stored = -1, 0, []
        if match:
            self.queries += len(tokens)
            donor, n = self.match(key, tokens, len(tokens) - 1)
            if self.store is not None:
                stored = self.store.match(key, tokens, len(tokens) - 1)
                if len(stored) * BLOCK > n:
                    donor, n = -1, len(stored) * BLOCK
                else:
                    stored = []
        victim = self.victim(donor)
        if self.store is not None and victim in self.rows:
            # Before the row is written over (past the n tokens it keeps, when it is the donor).
            self.store.save(victim, self.rows[victim], keep=stored)
        row = self.kv.alloc(victim)
        if stored:
            self.forget(row)
            self.store.load(row, stored)
            self.keep(row, key, tokens[:n])
            self.hits += n
        elif n:
            if donor != row:
                self.kv.copy_prefix(donor, row, n)
            self.keep(row, key, tokens[:n])
            self.hits += n
        else:
            self.forget(row)
        return row, n

    def victim(self, donor: int = -1) -> int:
        """The free row a new request gets: the lowest that holds nothing, else the one used
        least recently; `donor` (whose prefix it copies) only when no other is free."""
        def cost(row: int) -> tuple:
            held = self.rows.get(row)
            return (row == donor, held is not None, held.used if held is not None else 0, row)
        return min(self.kv.free_rows, key=cost)
