"""Per-request block tables on top of the BlockPool: slot allocation, prefix-cache hits,
forks with copy-on-write, swap to host and back.

With a sliding window on every layer of the model, a block that every future query has slid
past goes back to the pool (into the prefix cache, where it is full and hashed): its table
entry becomes the null block 0, which no kernel reads (a query sees only the last `window`
positions). Workers are not told: their copy of the table still names the old block, which
their kernels never read again either. A request then holds at most window + one block of KV
plus what its current step writes."""

from __future__ import annotations

from collections import Counter

from ..outputs import Fragmentation
from ..request import Request
from ..utils import cdiv
from .block_pool import BlockPool, KVBlock, hash_block_tokens
from .free_blocks import table_runs

# (index of the first changed entry, block ids from there on): how a step tells the worker
# what became of a block table. Usually an append; a copy-on-write replaces one entry; an
# empty list of ids means the table did not change.
TableDelta = tuple[int, list[int]]


class KVCacheManager:
    def __init__(
        self,
        block_size: int,
        num_blocks: int,
        enable_caching: bool = True,
        num_swap_blocks: int = 0,
        placement: str = "lru",
        sliding_window: int | None = None,
    ):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, placement)
        self.null = self.pool.block(0)  # the entry of a block released behind the window
        self.sliding_window = sliding_window
        self.tables: dict[str, list[KVBlock]] = {}
        self._num_hashed: dict[str, int] = {}  # leading blocks already registered in the cache
        self._num_released: dict[str, int] = {}  # leading entries released behind the window
        self.num_swap_blocks = num_swap_blocks
        self._swap_free: list[int] = list(range(num_swap_blocks - 1, -1, -1))
        self.swapped: dict[str, list[int]] = {}  # request id -> swap block ids
        self._copies: list[tuple[int, int]] = []  # copy-on-write (src, dst) since last take

    # --- queries --------------------------------------------------------------------------
    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.tables.get(request_id, ())]

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def num_blocks_of(self, request: Request) -> int:
        return len(self.tables.get(request.request_id, ()))

    def fragmentation(self, tokens_of: dict[str, int]) -> Fragmentation:
        """`tokens_of`: request id -> tokens its table holds (or is about to)."""
        tables = {rid: t for rid, t in self.tables.items() if t}
        slots = sum(len(t) for t in tables.values()) * self.block_size
        held = sum(min(tokens_of.get(rid, 0), len(t) * self.block_size) for rid, t in tables.items())
        sizes = sorted(len(t) for t in tables.values())
        need = sizes[len(sizes) // 2] if sizes else 1
        runs = self.pool.free_runs()
        free = sum(runs)
        runs_of = [table_runs([b.block_id for b in t]) for t in tables.values()]
        return Fragmentation(
            internal_waste=1 - held / slots if slots else 0.0,
            external=sum(r for r in runs if r < need) / free if free else 0.0,
            mean_table_run=sum(len(t) / n for t, n in zip(tables.values(), runs_of)) / len(tables) if tables else 0.0,
        )

    def blocks_released_by(self, requests: list[Request]) -> set[int]:
        """Ids of the blocks that ending all of `requests` would leave unreferenced: those no
        other request holds."""
        held = Counter(b.block_id for r in requests for b in self.tables.get(r.request_id, ()))
        block = self.pool.block
        return {i for i, n in held.items() if block(i).ref_cnt == n}

    def blocks_to_start(self, computed_blocks: list[KVBlock], num_tokens: int, released: set[int] = frozenset()) -> int:
        """Free blocks a request not yet started takes to hold its first `num_tokens` tokens,
        `computed_blocks` (prefix hits) among them: the fresh ones, and the hits that are free
        (cached, referenced by nobody, or only by requests whose blocks are `released`) and
        would be revived."""
        fresh = max(0, self.num_blocks_for(num_tokens) - len(computed_blocks))
        return fresh + sum(1 for b in self._held(computed_blocks) if b.ref_cnt == 0 or b.block_id in released)

    @property
    def num_free_swap_blocks(self) -> int:
        return len(self._swap_free)

    def take_block_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    # --- prefix cache ---------------------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest run of cached full blocks that prefixes the request's tokens. The last
        token is never taken from the cache: its logits have to be computed. The caller records
        the lookup in the pool's stats once the request is admitted.

        With a sliding window, the hits wholly behind the first query's window are the null
        block: no query reads them, so they are neither revived nor counted as needed (a long
        history would otherwise need more blocks than a windowed pool has, and never start).
        The last hit stays: the next block's prefix-cache key chains from it."""
        params = request.sampling_params
        if not self.enable_caching or params.prompt_logprobs is not None or whole_prompt_pooled(params):
            return [], 0  # prompt logprobs (and a mean or first-token embedding) come from computing the prompt
        bs = self.block_size
        max_blocks = (request.num_tokens - 1) // bs
        tokens = request.all_token_ids
        hits: list[KVBlock] = []
        parent = None
        for i, block_hash in enumerate(self._block_hashes(request, max_blocks)[:max_blocks]):
            parent = self.pool.lookup(block_hash, tuple(tokens[i * bs : (i + 1) * bs]), parent)
            if parent is None:
                break
            hits.append(parent)
        num_hit = len(hits) * bs
        if self.sliding_window and hits:
            behind = min(max(0, num_hit - self.sliding_window + 1) // bs, len(hits) - 1)
            hits[:behind] = [self.null] * behind
        return hits, num_hit

    def _block_hashes(self, request: Request, num_full: int) -> list[int]:
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else request.first_block_parent
            hashes.append(hash_block_tokens(parent, tuple(tokens[i * bs : (i + 1) * bs])))
        return hashes

    def _cache_full_blocks(self, request: Request, table: list[KVBlock], num_tokens: int) -> None:
        rid = request.request_id
        done = self._num_hashed[rid]
        # a slot planned for a token not yet sampled (async scheduling) waits to be hashed
        full = min(min(num_tokens, request.num_tokens) // self.block_size, len(table))
        if full <= done:
            return
        hashes = self._block_hashes(request, full)
        bs, tokens = self.block_size, request.all_token_ids
        for i in range(done, full):
            parent = table[i - 1] if i else None
            self.pool.cache_full_block(table[i], hashes[i], tuple(tokens[i * bs : (i + 1) * bs]), parent, request.lora)
        self._num_hashed[rid] = full

    def cache_planned_blocks(self, request: Request) -> None:
        """A token planned ahead of its sampling (async scheduling) is now known: the blocks it
        completed enter the prefix cache."""
        if not self.enable_caching:
            return
        rid = request.request_id
        done = self._num_hashed.get(rid)  # None: nothing allocated yet
        # called for every sampled token: most complete no block
        if done is not None and request.num_computed_tokens // self.block_size > done:
            self._cache_full_blocks(request, self.tables[rid], request.num_computed_tokens)

    # --- allocation -----------------------------------------------------------------------
    def _register(self, request_id: str, table: list[KVBlock]) -> list[KVBlock]:
        self.tables[request_id] = table
        self._num_hashed[request_id] = 0
        self._num_released[request_id] = 0
        return table

    def _held(self, table: list[KVBlock]) -> list[KVBlock]:
        """The table's blocks, without the null entries of blocks released behind the window."""
        return [b for b in table if b is not self.null]

    def _shared_partial_block(self, table: list[KVBlock], start: int) -> KVBlock | None:
        """The partly written block that the token at position `start` goes into, if others
        hold it too (a fork): writing there needs a copy first."""
        if start % self.block_size == 0:
            return None
        block = table[start // self.block_size]
        return block if block.ref_cnt > 1 else None

    def _holds_own_slots(self, table: list[KVBlock] | None, start: int, end: int) -> bool:
        """Whether the table already holds the slots of positions [start, end) and the partly
        written block at `start` is its own (not shared with a fork, which would need a copy)."""
        bs = self.block_size
        return table is not None and end <= len(table) * bs and (start % bs == 0 or table[start // bs].ref_cnt == 1)

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: list[KVBlock] = ()
    ) -> TableDelta | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones (and
        after `computed_blocks`, prefix hits taken now). Returns how the block table changed,
        or None — with nothing changed — when the free blocks do not suffice."""
        rid = request.request_id
        table = self.tables.get(rid)
        bs = self.block_size
        start = request.num_computed_tokens + len(computed_blocks) * bs
        end = start + num_new_tokens
        if table is not None and self.sliding_window:
            self._release_behind_window(rid, table, start)
        if not computed_blocks and self._holds_own_slots(table, start, end):
            # the common decode step: the table already holds the slots, and they are its own
            if self.enable_caching and end // bs > self._num_hashed[rid]:
                self._cache_full_blocks(request, table, end)
            return len(table), []
        if table is None:  # registered only once something is allocated
            table = []
        num_new_blocks = max(0, cdiv(end, bs) - len(table) - len(computed_blocks))
        shared = self._shared_partial_block(table, start)
        hits = self._held(computed_blocks)  # without those behind the window
        revived = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks + (shared is not None) > self.pool.num_free - revived:
            return None
        if rid not in self.tables:
            self._register(rid, table)
        first_changed = len(table)
        if computed_blocks:  # a request's first allocation: its table starts with them
            self.pool.touch(hits)
            table.extend(computed_blocks)
            self._num_hashed[rid] = len(computed_blocks)
            self._num_released[rid] = len(computed_blocks) - len(hits)
        if shared is not None:
            first_changed = start // self.block_size
            (copy,) = self.pool.allocate(1)
            self.pool.free((shared,))
            table[first_changed] = copy
            self._copies.append((shared.block_id, copy.block_id))
        table.extend(self.pool.allocate(num_new_blocks, after=table[-1].block_id if table else None))
        if self.enable_caching:
            self._cache_full_blocks(request, table, end)
        return first_changed, [b.block_id for b in table[first_changed:]]

    def allocate_decode_slots(self, requests: list[Request], num_tokens: int = 1) -> list[TableDelta] | None:
        """allocate_slots(r, num_tokens) for each of `requests` (async scheduling's planned step,
        or a decode run of num_tokens steps), or None, with nothing changed, when the free blocks
        do not suffice for all of them. Most tables hold the slots already: those are answered
        here, without a call each."""
        bs, tables = self.block_size, self.tables
        deltas: list = [None] * len(requests)
        rest = []
        for i, request in enumerate(requests):
            table = tables.get(request.request_id)
            start = request.num_computed_tokens
            end = start + num_tokens
            if table is not None and self.sliding_window:
                self._release_behind_window(request.request_id, table, start)
            if self._holds_own_slots(table, start, end) and (
                not self.enable_caching or end // bs <= self._num_hashed[request.request_id]
            ):
                deltas[i] = (len(table), [])  # what allocate_slots answers, with nothing to hash
            else:
                rest.append(i)
        if rest and self.blocks_needed([requests[i] for i in rest], num_tokens) > self.pool.num_free:
            return None
        for i in rest:
            deltas[i] = self.allocate_slots(requests[i], num_tokens)
        return deltas

    def _release_behind_window(self, rid: str, table: list[KVBlock], start: int) -> None:
        """Release the blocks no query from position `start` on can see: those wholly before
        start - window + 1. With prefix caching, a block stays until the one after it is hashed
        (its key chains from it)."""
        done = self._num_released[rid]
        first_seen = start - self.sliding_window + 1
        upto = min(first_seen // self.block_size, len(table) - 1)
        if self.enable_caching:
            upto = min(upto, self._num_hashed[rid] - 1)
        if upto <= done:
            return
        released = [b for b in table[done:upto] if b is not self.null]  # a fork's null entries
        table[done:upto] = [self.null] * (upto - done)
        self.pool.free(reversed(released))
        self._num_released[rid] = upto

    def blocks_needed(self, requests: list[Request], num_new_tokens: int) -> int:
        """Free blocks that allocate_slots(r, num_new_tokens) for each of `requests`, in order,
        would take, counting that a shared block copied for one no longer needs a copy for
        the last of its holders."""
        copies: Counter = Counter()
        need = 0
        for request in requests:
            table = self.tables.get(request.request_id, [])
            start = request.num_computed_tokens
            need += max(0, cdiv(start + num_new_tokens, self.block_size) - len(table))
            block = self._shared_partial_block(table, start)
            if block is not None and block.ref_cnt - copies[block.block_id] > 1:
                copies[block.block_id] += 1
                need += 1
        return need

    def fork(self, parent: Request, child: Request) -> None:
        """The child shares every block of the parent; the first write into a shared
        partial block copies it (see allocate_slots)."""
        table = self.tables[parent.request_id]
        self.pool.touch(self._held(table))
        self._register(child.request_id, list(table))
        self._num_hashed[child.request_id] = self._num_hashed[parent.request_id]
        self._num_released[child.request_id] = self._num_released[parent.request_id]

    def free(self, request: Request) -> None:
        rid = request.request_id
        table = self.tables.pop(rid, None)
        if table is not None:
            self.pool.free(reversed(self._held(table)))
            del self._num_hashed[rid], self._num_released[rid]
        swap_ids = self.swapped.pop(rid, None)
        if swap_ids is not None:
            self._swap_free.extend(reversed(swap_ids))

    def forget_beyond(self, request: Request) -> None:
        """The request's tokens past num_computed_tokens were not computed after all (a step
        that never finished): its blocks past them leave the prefix cache, and those that held
        only them go back to the pool (a fork of a table with blocks beyond its tokens would
        share a block both then write)."""
        rid = request.request_id
        table = self.tables.get(rid)
        if table is None:
            return
        first = request.num_computed_tokens // self.block_size
        for block in self._held(table[first : self._num_hashed[rid]]):
            self.pool.uncache(block)
        self._num_hashed[rid] = min(self._num_hashed[rid], first)
        keep = cdiv(request.num_computed_tokens, self.block_size)
        self.pool.free(reversed(self._held(table[keep:])))
        del table[keep:]
        self._num_released[rid] = min(self._num_released[rid], keep)

    def window_released(self, request: Request) -> bool:
        """Whether the request released a block that its next query (at num_computed_tokens)
        reads: a step undone after a later one released the blocks behind its own window."""
        released = self._num_released.get(request.request_id)
        if not released:
            return False
        first_seen = max(0, request.num_computed_tokens - self.sliding_window + 1)
        return released > first_seen // self.block_size

    # --- swap -----------------------------------------------------------------------------
    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move a request's blocks to the swap space: (device block, swap block) pairs to copy,
        or None if the swap space is too full — or if it released blocks behind its window
        (it is recomputed instead: swapped back in, they would be blocks without their K/V)."""
        if self._num_released.get(request.request_id):
            return None
        table = self.tables.get(request.request_id, [])
        if len(table) > len(self._swap_free):
            return None
        swap_ids = [self._swap_free.pop() for _ in table]
        pairs = [(b.block_id, s) for b, s in zip(table, swap_ids)]
        self.free(request)
        self.swapped[request.request_id] = swap_ids
        return pairs

    def swap_in(self, request: Request) -> list[tuple[int, int]] | None:
        """Bring a swapped request back: (swap block, device block) pairs, or None if the
        device has too few free blocks."""
        rid = request.request_id
        swap_ids = self.swapped[rid]
        if len(swap_ids) > self.pool.num_free:
            return None
        del self.swapped[rid]
        blocks = self._register(rid, self.pool.allocate(len(swap_ids)))
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, request.num_computed_tokens)
        self._swap_free.extend(reversed(swap_ids))
        return [(s, b.block_id) for s, b in zip(swap_ids, blocks)]

    # --- checks ---------------------------------------------------------------------------
    def check_invariants(self) -> None:
        holders = Counter(b.block_id for table in self.tables.values() for b in self._held(table))
        self.pool.check_invariants(holders)
        held_swap = [s for ids in self.swapped.values() for s in ids]
        assert len(set(held_swap)) == len(held_swap), "a swap block is held twice"
        assert not set(held_swap) & set(self._swap_free), "a swap block is held and free"
        assert len(held_swap) + len(self._swap_free) == self.num_swap_blocks, "swap blocks leaked"
        assert not set(self.tables) & set(self.swapped), "a request is on device and swapped"


def whole_prompt_pooled(params) -> bool:
    """An embedding that needs every prompt token's hidden state (MEAN) or the first one's (CLS):
    no prefix-cache hit may skip computing them (LAST needs only the last token, always computed)."""
    return params.pooling is not None and params.pooling.pooling_type != "LAST"
