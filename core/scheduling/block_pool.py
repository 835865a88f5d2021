"""Fixed pool of KV blocks: allocate/free (O(1) under the lru placement), ref counts, and a
content-hashed prefix cache.

A free block is in exactly one of two places:
- `_free`: never cached (no hash) — handed out first, in the order of the block placement
  policy (core/scheduling/free_blocks.py: lru, first-fit, best-fit);
- the LRU list: full blocks whose content hash is still registered, kept so an equal prefix can
  revive them; evicted oldest-first only when `_free` is empty. The list is intrusive
  (prev/next on the block), so revival from the middle is O(1).
A cached block keeps its token ids and its parent (the cached block before it, and which
registration of that block): a lookup hits only when both match, so a hit is impossible
without an equal prefix however the keys collide.
Block 0 is the null block: never allocated, so a zero in a block table means "no block".
"""

from __future__ import annotations

from collections.abc import Iterable

from .free_blocks import make_free_blocks


def hash_block_tokens(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Chained key of a full block: equal prefixes give equal keys, block by block. Built from
    ints and tuples only, whose hashes Python does not randomise, so keys repeat across
    processes; a key only finds a candidate, which lookup() then checks token by token."""
    return hash((-1 if parent_hash is None else parent_hash, token_ids))


class KVBlock:
    __slots__ = (
        "block_id",
        "ref_cnt",
        "block_hash",
        "token_ids",
        "parent",
        "parent_serial",
        "serial",
        "lora",
        "prev",
        "next",
    )

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        # while cached: its tokens, and the cached block before it with that block's serial then
        self.token_ids: tuple[int, ...] | None = None
        self.parent: KVBlock | None = None
        self.parent_serial = 0
        self.serial = 0  # which registration in the cache this is (a block is reused after eviction)
        self.lora = None  # the LoRARequest its K/V were computed under (KV events name it)
        self.prev: KVBlock | None = None
        self.next: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hash={self.block_hash})"


class _LRUList:
    """Doubly linked list through KVBlock.prev/next with sentinel ends."""

    def __init__(self):
        self.head = KVBlock(-1)
        self.tail = KVBlock(-1)
        self.head.next = self.tail
        self.tail.prev = self.head
        self.size = 0

    def append(self, block: KVBlock) -> None:
        last = self.tail.prev
        last.next = block
        block.prev = last
        block.next = self.tail
        self.tail.prev = block
        self.size += 1

    def remove(self, block: KVBlock) -> None:
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self.size -= 1

    def pop_oldest(self) -> KVBlock:
        block = self.head.next
        self.remove(block)
        return block

    def __iter__(self):
        block = self.head.next
        while block is not self.tail:
            yield block
            block = block.next


class BlockPool:
    def __init__(self, num_blocks: int, placement: str = "lru"):
        if num_blocks < 2:
            raise ValueError("num_blocks must be >= 2: block 0 is reserved")
        self.num_blocks = num_blocks
        self.placement = placement
        # each id's KVBlock, made when the block is first taken: a pool has ~100k blocks, and
        # making them all took ~0.1 s of every engine start (block(i) is the way in)
        self._blocks: list[KVBlock | None] = [None] * num_blocks
        self._blocks[0] = KVBlock(0)
        self._free = make_free_blocks(placement, range(1, num_blocks))
        self._lru = _LRUList()
        self._cached: dict[int, KVBlock] = {}
        self._registrations = 0
        # the prefix cache's changes, kept for KV events (core/kv_events.py) while a list:
        # ("stored", hash, parent hash, token ids, LoRARequest | None), ("removed", hash), ("cleared",)
        self.events: list[tuple] | None = None
        self.prefix_queries = 0  # tokens looked up in the prefix cache
        self.prefix_hits = 0  # of those, tokens found
        self.peak_used = 0

    # --- counts ---------------------------------------------------------------------------
    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now, evicting cached ones if need be."""
        return len(self._free) + self._lru.size

    @property
    def num_used(self) -> int:
        return self.num_usable - self.num_free

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached-but-free blocks do not count)."""
        return self.num_used / self.num_usable

    @property
    def num_cached_free(self) -> int:
        return self._lru.size

    def free_runs(self) -> list[int]:
        """Lengths of the runs of consecutive never-cached free block ids."""
        return self._free.runs()

    def block(self, block_id: int) -> KVBlock:
        block = self._blocks[block_id]
        if block is None:
            block = self._blocks[block_id] = KVBlock(block_id)
        return block

    # --- allocation -----------------------------------------------------------------------
    def allocate(self, n: int, after: int | None = None) -> list[KVBlock]:
        """n blocks, never-cached ones first (`after`: the block they follow in a table, for
        the fit policies to continue its run), then the oldest cached-but-free ones."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free} free")
        plain = min(n, len(self._free))
        out = [self.block(i) for i in self._free.take(plain, after)] if plain else []
        for _ in range(n - plain):
            block = self._lru.pop_oldest()
            self._evict(block)
            out.append(block)
        for block in out:
            block.ref_cnt = 1
        used = self.num_used
        if used > self.peak_used:
            self.peak_used = used
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (prefix hit or fork), reviving cached ones."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._lru.remove(block)
            block.ref_cnt += 1
        used = self.num_used
        if used > self.peak_used:
            self.peak_used = used

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block. Pass a request's blocks last-first: its tail
        blocks then sit older in the LRU and are evicted before its prefix."""
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._free.put(block.block_id)
                else:
                    self._lru.append(block)
            elif block.ref_cnt < 0:
                raise RuntimeError(f"block {block.block_id} freed more often than allocated")

    # --- prefix cache ---------------------------------------------------------------------
    def lookup(self, block_hash: int, token_ids: tuple[int, ...], parent: KVBlock | None) -> KVBlock | None:
        """The cached block holding `token_ids` right after `parent` (None: at the start of a
        sequence), or None. The key only finds the candidate; tokens and parent must match."""
        block = self._cached.get(block_hash)
        if block is None or block.token_ids != token_ids or block.parent is not parent:
            return None
        if parent is not None and block.parent_serial != parent.serial:
            return None  # its parent's block was evicted and reused since
        return block

    def cache_full_block(
        self, block: KVBlock, block_hash: int, token_ids: tuple[int, ...], parent: KVBlock | None, lora=None
    ) -> None:
        """Register a block whose slots are all written, as following `parent`. If a block is
        already registered under the key, or the parent is not cached (no lookup could reach
        this block), it stays uncached (it is freed to the plain list later)."""
        if block.block_hash is not None or block_hash in self._cached:
            return
        if parent is not None and parent.block_hash is None:
            return
        self._registrations += 1
        block.block_hash, block.token_ids, block.serial = block_hash, token_ids, self._registrations
        block.parent, block.parent_serial = parent, parent.serial if parent is not None else 0
        block.lora = lora
        self._cached[block_hash] = block
        if self.events is not None:
            parent_hash = parent.block_hash if parent is not None else None
            self.events.append(("stored", block_hash, parent_hash, token_ids, lora))

    def record_lookup(self, queried_tokens: int, hit_tokens: int) -> None:
        self.prefix_queries += queried_tokens
        self.prefix_hits += hit_tokens

    def reset_prefix_cache(self) -> None:
        """Forget every cached block (e.g. after the KV storage was lost): one "cleared" event."""
        events, self.events = self.events, None
        self.drop_free_cached()
        for block in list(self._cached.values()):
            self._evict(block)
        self.events = events
        if events is not None:
            events.append(("cleared",))

    def announce(self) -> None:
        """Events that tell a subscriber the whole cache again: "cleared", then every cached
        block, parents first (after the workers were replaced, its view may have missed some)."""
        if self.events is None:
            return
        self.events.append(("cleared",))
        for block in sorted(self._cached.values(), key=lambda b: b.serial):
            parent = block.parent.block_hash if block.parent is not None else None
            self.events.append(("stored", block.block_hash, parent, block.token_ids, block.lora))

    @property
    def num_cached(self) -> int:
        """Blocks registered in the prefix cache, held or free."""
        return len(self._cached)

    def drop_free_cached(self) -> None:
        """Forget the cached blocks nobody holds."""
        while self._lru.size:
            block = self._lru.pop_oldest()
            self._evict(block)
            self._free.put(block.block_id)

    def uncache(self, block: KVBlock) -> None:
        """Take a held block out of the prefix cache (its content is not what its key says)."""
        if block.ref_cnt == 0:
            raise RuntimeError(f"block {block.block_id} is free: uncache only held blocks")
        self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            if self.events is not None:
                self.events.append(("removed", block.block_hash))
            block.block_hash = block.token_ids = block.parent = block.lora = None

    # --- checks ---------------------------------------------------------------------------
    def check_invariants(self, ref_counts: dict[int, int]) -> None:
        """`ref_counts`: block id -> how many block tables hold it. Raises AssertionError."""
        free_ids = list(self._free)
        assert len(set(free_ids)) == len(free_ids), "a block is twice in the free list"
        lru_ids = [b.block_id for b in self._lru]
        assert len(lru_ids) == self._lru.size, "LRU size out of step with its links"
        assert not set(free_ids) & set(lru_ids), "a block is in both free lists"
        assert 0 not in ref_counts and 0 not in free_ids and 0 not in lru_ids, "null block 0 in use"
        assert self._blocks[0].ref_cnt == 0
        free_set, lru_set = set(free_ids), set(lru_ids)
        for block_id, block in enumerate(self._blocks[1:], start=1):
            if block is None:  # never taken
                assert block_id in free_set and block_id not in ref_counts, f"block {block_id} was never allocated"
                continue
            held = ref_counts.get(block.block_id, 0)
            assert block.ref_cnt == held, f"{block}: ref count != {held} block tables holding it"
            in_free = block.block_id in free_set
            in_lru = block.block_id in lru_set
            if held:
                assert not in_free and not in_lru, f"{block} is held and free"
            else:
                assert in_free != in_lru, f"{block} is neither free, cached nor held"
                assert (block.block_hash is not None) == in_lru, f"{block} is in the wrong free list"
        for block_hash, block in self._cached.items():
            assert block.block_hash == block_hash, f"{block} is registered under another hash"
        held = sum(1 for b in self._blocks[1:] if b is not None and b.ref_cnt)
        assert len(free_ids) + len(lru_ids) + held == self.num_usable
