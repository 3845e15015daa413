"""KV offloading (server/prefix_store.py, --kv-offloading-size): the prefix cache's host tier.

The store: a row's whole blocks saved once (only those it lacks, as one contiguous extent)
and loaded back bit for bit into another row; keys kept apart, a collision a miss; the least
recently used extent evicted first, never one the admission loads from. The prefix cache:
the row an admission takes is saved first, and a prompt the store holds further than any
row is loaded from it. The engine: with more system prompts than KV rows, a prompt whose
row was reused is found in the host tier and gives HF transformers + peft's greedy tokens."""

from __future__ import annotations

import random

import pytest
import torch

from loraplex.server.config import named_shape
from loraplex.server.kv_cache import KVCache
from loraplex.server.prefix_cache import BLOCK, PrefixCache
from loraplex.server.prefix_store import HostPrefixStore


def make(rows: int = 3, blocks: int = 16, max_len: int = 96) -> tuple[PrefixCache, HostPrefixStore]:
    kv = KVCache(named_shape("tiny"), rows, max_len, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(0)
    kv.k_all.normal_(generator=gen)
    kv.v_all.normal_(generator=gen)
    store = HostPrefixStore(kv, blocks * HostPrefixStore.bytes_per_block(kv))
    return PrefixCache(kv, store), store


def held(cache: PrefixCache, row: int, n: int) -> torch.Tensor:
    """K and V of positions 0..n-1 of `row`, every layer."""
    return torch.stack([cache.kv.k_all[:, row, :, :n], cache.kv.v_all[:, row, :, :n]]).clone()


def test_a_saved_prefix_loads_back_bit_for_bit_into_another_row():
    cache, store = make()
    tokens = list(range(100, 140))  # 2 whole blocks and 8 tokens
    cache.keep(1, ("a",), tokens)
    want = held(cache, 1, 2 * BLOCK)
    assert store.save(1, cache.rows[1]) == 2 * BLOCK and store.blocks_used == 2
    cache.kv.k_all[:, 1].zero_()
    cache.kv.v_all[:, 1].zero_()
    blocks = store.match(("a",), tokens + [1], 40)
    assert len(blocks) == 2
    assert store.load(2, blocks) == 2 * BLOCK
    assert torch.equal(held(cache, 2, 2 * BLOCK), want)
    assert store.match(("b",), tokens, 40) == []  # another key
    assert len(store.match(("a",), tokens, 20)) == 1  # the limit: whole blocks under it
    assert store.match(("a",), [7] + tokens[1:], 40) == []  # the first block differs


def test_each_block_is_kept_once_and_a_collision_is_a_miss():
    cache, store = make()
    system = list(range(200, 232))  # 2 blocks
    cache.keep(0, ("a",), system + list(range(10, 26)))  # + 1 block
    cache.keep(1, ("a",), system + list(range(50, 82)))  # + 2 other blocks
    assert store.save(0, cache.rows[0]) == 3 * BLOCK
    assert store.save(1, cache.rows[1]) == 2 * BLOCK  # the system prompt's blocks are there already
    assert store.save(1, cache.rows[1]) == 0
    assert store.blocks_used == 5 and len(store._extents) == 2
    assert len(store.match(("a",), system + list(range(50, 82)), 64)) == 4
    # A hash that names other tokens (a collision) ends the match there.
    extent, i = store._index[cache.rows[0].hashes[2]]
    extent.tokens[i * BLOCK] = -1
    assert len(store.match(("a",), system + list(range(10, 26)), 48)) == 2


def test_the_least_recently_used_extent_goes_first_never_the_one_being_loaded():
    cache, store = make(rows=4, blocks=4)
    prompts = {name: [k] * 2 * BLOCK for k, name in enumerate("abc", start=1)}
    for row, name in enumerate("ab"):
        cache.keep(row, (name,), prompts[name])
        assert store.save(row, cache.rows[row]) == 2 * BLOCK
    assert len(store.match(("a",), prompts["a"], 32)) == 2  # a is used now: b is the oldest
    cache.keep(2, ("c",), prompts["c"])
    assert store.save(2, cache.rows[2]) == 2 * BLOCK
    assert store.match(("b",), prompts["b"], 32) == [] and len(store.match(("c",), prompts["c"], 32)) == 2
    # A save that would need the blocks an admission is loading saves only what fits around them.
    a, c = store.match(("a",), prompts["a"], 32), store.match(("c",), prompts["c"], 32)
    cache.keep(3, ("d",), [9] * 3 * BLOCK)
    assert store.save(3, cache.rows[3], keep=a + c) == 0
    assert store.match(("a",), prompts["a"], 32) == a and store.match(("c",), prompts["c"], 32) == c
    assert store.save(3, cache.rows[3], keep=a) == 2 * BLOCK  # c goes (older than a now); 2 of 3 fit
    assert store.match(("c",), prompts["c"], 32) == [] and store.match(("a",), prompts["a"], 32) == a


def test_eviction_coalesces_free_space():
    cache, store = make(rows=4, blocks=6)
    for row, name in enumerate("abc"):
        cache.keep(row, (name,), [row + 1] * 2 * BLOCK)
        store.save(row, cache.rows[row])
    assert store._free == []
    for name in "ab":  # c is the newest; a and b go, and their blocks make one run of 4
        store._evict(next(e for e in store._extents.values() if e.key == (name,)))
    assert store._free == [(0, 4)]
    cache.keep(3, ("d",), [7] * 4 * BLOCK)
    assert store.save(3, cache.rows[3]) == 4 * BLOCK and store._free == []


def test_an_admission_saves_the_row_it_takes_and_loads_what_only_the_store_holds():
    cache, store = make(rows=2)
    system = list(range(300, 348))  # 3 blocks
    first = cache.admit(("a",), system + [1, 2, 3])
    assert first == (0, 0)
    cache.keep(0, ("a",), system + [1, 2, 3])  # its prefill ran
    want = held(cache, 0, 3 * BLOCK)
    cache.kv.free(0)
    # Another prompt takes row 0 (row 1 is free and empty: it goes there), then a third row 0's.
    assert cache.admit(("b",), [5] * 40)[0] == 1
    cache.keep(1, ("b",), [5] * 40)
    cache.kv.free(1)
    row, n = cache.admit(("c",), [6] * 40)  # the least recently used row: 0, saved first
    assert (row, n) == (0, 0) and store.saved_tokens == 3 * BLOCK
    cache.keep(0, ("c",), [6] * 40)
    cache.kv.free(0)
    # The system prompt again: no row holds it (row 0 holds c's now), the store does.
    row, n = cache.admit(("a",), system + [9])
    assert n == 3 * BLOCK and store.loaded_tokens == 3 * BLOCK and cache.hits == 3 * BLOCK
    assert torch.equal(held(cache, row, 3 * BLOCK), want)
    assert cache.rows[row].tokens == system


def test_the_flag():
    from loraplex.server.settings import ServerSettings

    assert ServerSettings(dummy_weights="tiny").kv_offloading_size == 0
    assert ServerSettings.from_env_and_args(["--dummy-weights", "tiny", "--kv-offloading-size", "0.25"]) \
        .kv_offloading_size == 0.25
    with pytest.raises(ValueError, match="needs prefix caching"):
        ServerSettings(dummy_weights="tiny", kv_offloading_size=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="at least 0"):
        ServerSettings(dummy_weights="tiny", kv_offloading_size=-1)
    kv = KVCache(named_shape("tiny"), 1, 32, torch.device("cpu"), torch.float32)
    with pytest.raises(ValueError, match="no block"):
        HostPrefixStore(kv, 100)


@pytest.mark.parametrize("offload", [False, True], ids=["rows-only", "host-tier"])
def test_more_system_prompts_than_rows(hf_llama, llama_adapters, offload):
    """Two KV rows, three system prompts of one adapter, asked in turn, one request at a time:
    each request's row is taken by the next, so by its second turn a system prompt is in no
    row; with the host tier it is found there. Outputs equal HF transformers + peft's."""
    from loraplex.server.engine import LLMEngine
    from loraplex.server.sampling import SamplingParams
    from loraplex.server.settings import ServerSettings

    from .test_parity import hf_greedy

    name = next(iter(llama_adapters))
    engine = LLMEngine.from_settings(ServerSettings(
        model=str(hf_llama), device="cpu", dtype="float32", max_num_seqs=2, max_model_len=128, max_loras=2,
        max_lora_rank=16, lora_modules=[f"{name}={llama_adapters[name]}"], kv_offloading_size=0.01 if offload else 0))
    rng = random.Random(3)
    systems = [[1] + [rng.randrange(3, 320) for _ in range(40)] for _ in range(3)]
    cached = []
    for turn in range(2):
        for system in systems:
            prompt = system + [rng.randrange(3, 320) for _ in range(4)]
            req = engine.make_request(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), name)
            engine.add_request(req)
            while engine.has_work():
                engine.step()
            assert req.output_ids == hf_greedy(hf_llama, llama_adapters[name], prompt, 4)
            cached.append(req.cached_tokens)
    assert cached[:3] == [0, 0, 0]
    assert cached[3:] == ([2 * BLOCK] * 3 if offload else [0] * 3)
    engine.metrics.refresh(engine)
    metric = lambda name: engine.metrics.registry.get_sample_value(name)  # noqa: E731
    assert metric("loraplex_kv_offload_hit_tokens_total") == sum(cached[3:])
    assert metric("vllm:prefix_cache_hits_total") == sum(cached)
    if offload:
        assert metric("loraplex_kv_offload_saved_tokens_total") >= 3 * 2 * BLOCK
        assert 0 < metric("loraplex_kv_offload_usage_perc") <= 1
    else:
        assert metric("loraplex_kv_offload_saved_tokens_total") == 0 == metric("loraplex_kv_offload_usage_perc")


def test_a_save_never_evicts_the_blocks_its_own_chain_starts_with():
    """The system prompt's blocks are the oldest extent, but the question's blocks saved after
    them would be out of reach without them: another extent goes instead."""
    cache, store = make(rows=3, blocks=5)
    system, other = list(range(400, 432)), [3] * 2 * BLOCK  # 2 blocks each
    cache.keep(0, ("a",), system)
    store.save(0, cache.rows[0])
    cache.keep(1, ("b",), other)
    store.save(1, cache.rows[1])
    assert len(store.match(("b",), other, 32)) == 2  # b is used now, a's extent is the oldest
    cache.keep(2, ("a",), system + [5] * 2 * BLOCK)
    assert store.save(2, cache.rows[2]) == 2 * BLOCK
    assert len(store.match(("a",), system + [5] * 2 * BLOCK, 64)) == 4 and store.match(("b",), other, 32) == []


def test_page_locked_memory_is_unregistered_when_its_last_view_goes(monkeypatch):
    """The store's host memory is registered with CUDA in place; freed while still registered,
    it broke the next cuBLAS handle the process made (on the H200). It is unregistered, at
    the address it was registered at, only once nothing views it; a failed registration is
    never unregistered, and the memory is still usable."""
    import gc

    from loraplex.server import prefix_store

    calls = []

    class Cudart:
        status = 0

        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size))
            return self.status

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    cudart = Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    t = prefix_store.host_buffer((4, 3, 5), torch.float16, pin=True)
    assert t.shape == (4, 3, 5) and t.dtype == torch.float16
    t.fill_(1.5)
    assert calls == [("register", t.data_ptr(), 4 * 3 * 5 * 2)]
    address, view = t.data_ptr(), t[2:]
    del t
    gc.collect()
    assert len(calls) == 1  # a view still reads it
    assert view.sum().item() == 2 * 3 * 5 * 1.5
    del view
    gc.collect()
    assert calls[1:] == [("unregister", address)]

    cudart.status = 1  # cudaErrorInvalidValue: not locked, plain memory
    t = prefix_store.host_buffer((8,), torch.float32, pin=True)
    t.copy_(torch.arange(8.0))
    assert t.sum().item() == 28 and len(calls) == 3
    del t
    gc.collect()
    assert len(calls) == 3
    assert prefix_store.host_buffer((2, 2), torch.float32, pin=False).shape == (2, 2) and len(calls) == 3


def test_saves_on_the_copy_stream_are_ordered_against_the_rows_the_ring_and_the_loads(monkeypatch):
    """The order in which the store's copies run on CUDA (_save_async and load), checked on
    the CPU with stand-ins for streams and events that keep it (stream_order.py): a save's
    copy to the host after its gather into the ring, a gather into a ring chunk after that
    chunk's last copy out, a load after the copy of the blocks it reads, a save's copy into
    blocks after the load queued from them before it, the prefill that overwrites a row
    after the gather out of it. More saves than the ring has chunks; the loads bit for bit."""
    from loraplex.server import prefix_store

    from .stream_order import StreamOrder

    blocks = 3 * prefix_store.STAGE
    kv = KVCache(named_shape("tiny"), 3, blocks * BLOCK + 1, torch.device("cpu"), torch.float32)
    gen = torch.Generator().manual_seed(0)
    kv.k_all.normal_(generator=gen)
    kv.v_all.normal_(generator=gen)
    store = HostPrefixStore(kv, 4 * blocks * HostPrefixStore.bytes_per_block(kv))
    store._async_saves = True  # as on CUDA with the host memory page-locked
    cache = PrefixCache(kv, store)

    def label(t: torch.Tensor) -> set:
        ptr = t.data_ptr()

        def within(base: torch.Tensor | None) -> bool:
            return base is not None and base.data_ptr() <= ptr < base.data_ptr() + base.nbytes

        if within(store._ring):
            return {("ring", (ptr - store._ring.data_ptr()) // store._ring[0].nbytes)}
        if within(store.data):
            first = (ptr - store.data.data_ptr()) // store.block_bytes
            return {("block", b) for b in range(first, first + t.nbytes // store.block_bytes)}
        for part in (kv.k_all, kv.v_all):
            if within(part):
                return {("row", (ptr - part.data_ptr()) // (part.stride(1) * part.element_size()) % kv.rows)}
        return {("stage",)} if within(store._stage) else set()

    order = StreamOrder(label)
    order.install(monkeypatch)

    def read(row: int) -> torch.Tensor:
        order.access("read", reads={("row", row)})
        return held(cache, row, blocks * BLOCK)

    prompts = [[i + 1] * blocks * BLOCK for i in range(5)]
    want = []
    for i, tokens in enumerate(prompts):
        row = i % 2
        if i == 4:  # a load from the first prompt's blocks, queued before the save that evicts them
            store.load(2, store.match(("p", 0), prompts[0], len(prompts[0]), touch=False))
            first_loaded = read(2)
        cache.keep(row, ("p", i), tokens)
        want.append(read(row))
        assert store.save(row, cache.rows[row]) == blocks * BLOCK
        order.access("prefill", writes={("row", row)})  # the prefill after the save overwrites the row
        kv.k_all[:, row].normal_(generator=gen)
        kv.v_all[:, row].normal_(generator=gen)
        if i == 1:  # loaded back at once
            store.load(2, store.match(("p", 1), tokens, len(tokens), touch=False))
            assert torch.equal(read(2), want[1])
    assert torch.equal(first_loaded, want[0])
    for i in range(1, 5):
        store.load(2, store.match(("p", i), prompts[i], len(prompts[i])))
        assert torch.equal(read(2), want[i]), i
    assert len(store._ring) < 5 * 3  # the ring wrapped: 5 saves of 3 chunks
    assert order.races() == []


def test_the_stream_order_checker_sees_a_missing_wait(monkeypatch):
    from .stream_order import StreamOrder

    order = StreamOrder(lambda t: set())
    order.install(monkeypatch)
    side = torch.cuda.Stream()
    order.access("gather", writes={"ring"})
    with torch.cuda.stream(side):
        order.access("copy out", reads={"ring"})  # no wait for the gather
    assert [(a, b) for a, b, _ in order.races()] == [("gather@compute", "copy out@side1")]
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream())
    side.wait_event(done)
    with torch.cuda.stream(side):
        order.access("copy out again", reads={"ring"})
    assert len(order.races()) == 1  # the second one waited


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("busy", ["compute", "copy"])
def test_cuda_saves_on_their_copy_stream_load_back_bit_for_bit(busy):
    """On CUDA a save's copy to the host runs on a copy stream from a ring of staging chunks,
    while the compute stream goes on and overwrites the row (as the prefill that follows a
    save does). Blocks of Llama-3-8B's K/V shape (each copy takes a while), every allocation
    made first, then one stream held busy so that what it runs comes late: more saves than
    the ring has chunks, each loaded back bit for bit, also one loaded at once, and a load
    queued from blocks that a later save reuses still reads what they held.

    Each of the three waits matters with one stream late. Compute late: a copy to the host
    that did not wait for its gather would read the ring before it. Copy stream late (the
    compute stream runs ahead): a load that did not wait for the save of its blocks would read
    them before they are written (with both on time that mutant passed on the H200: the load,
    likely, trails the copy writing its blocks in the same order), and a gather that did not wait for
    its ring chunk's last copy would overwrite it before that copy read it."""
    import dataclasses

    from loraplex.server import prefix_store

    cfg = dataclasses.replace(named_shape("tiny"), num_layers=32, num_kv_heads=8, head_dim=128)
    blocks = 3 * prefix_store.STAGE  # 3 ring chunks a save: 5 saves wrap the ring
    assert 5 * 3 > prefix_store.SAVE_CHUNKS
    kv = KVCache(cfg, 3, blocks * BLOCK + 1, torch.device("cuda"), torch.float32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv.k_all.normal_(generator=gen)
    kv.v_all.normal_(generator=gen)
    store = HostPrefixStore(kv, 4 * blocks * HostPrefixStore.bytes_per_block(kv))  # 4 saves fit
    cache = PrefixCache(kv, store)
    assert store.data.is_pinned()
    prompts = [[i + 1] * blocks * BLOCK for i in range(5)]

    # The ring, the copy stream, the load staging and the clones' memory first: an allocation
    # from the driver may wait for the device, which would order what the test races.
    cache.keep(0, ("warm",), [9] * blocks * BLOCK)
    store.save(0, cache.rows[0])
    store.load(2, store.match(("warm",), [9] * blocks * BLOCK, blocks * BLOCK))
    warm = [held(cache, 2, blocks * BLOCK) for _ in range(6)]  # as many as the test holds at once
    torch.cuda.synchronize()
    store.clear()
    del warm

    want = []
    if busy == "compute":
        torch.cuda._sleep(1_000_000_000)  # about half a second
    else:
        with torch.cuda.stream(store._copier):
            torch.cuda._sleep(2_000_000_000)  # about a second, while the compute stream goes on
    for i, tokens in enumerate(prompts):
        row = i % 2
        if i == 4:  # a load of the first prompt's blocks, queued before the save that evicts them
            first = store.match(("p", 0), prompts[0], len(prompts[0]), touch=False)
            assert len(first) == blocks
            store.load(2, first)
        cache.keep(row, ("p", i), tokens)
        want.append(held(cache, row, blocks * BLOCK))
        assert store.save(row, cache.rows[row]) == blocks * BLOCK
        kv.k_all[:, row].normal_(generator=gen)  # the prefill after the save overwrites the row
        kv.v_all[:, row].normal_(generator=gen)
        if i == 1:  # loaded back at once: the load waits for the copy of its blocks to the host
            store.load(2, store.match(("p", 1), tokens, len(tokens), touch=False))
            early = held(cache, 2, blocks * BLOCK)
    assert store.match(("p", 0), prompts[0], len(prompts[0])) == []  # evicted by the fifth
    torch.cuda.synchronize()
    assert torch.equal(early, want[1])
    assert torch.equal(held(cache, 2, blocks * BLOCK), want[0])
    for i in range(1, 5):
        got = store.match(("p", i), prompts[i], len(prompts[i]))
        assert len(got) == blocks
        store.load(2, got)
        assert torch.equal(held(cache, 2, blocks * BLOCK), want[i]), i
