"""Paged KV cache bookkeeping: which physical blocks each request owns (`BlockManager`), and the same with automatic
prefix caching (`PrefixCachingBlockManager`). Knows nothing of the model.

Automatic prefix caching: KV blocks of generations outlive their requests and are shared by content.

A full block of tokens (prompt or generated: vLLM's rule) is named by a hash chain: sha256 of the previous block's
name and this block's token ids, so a name stands for the whole sequence up to the block's end. Once computed, the
block is registered under its name; a new prompt that starts with the same tokens takes those blocks (reference
counted) and starts computing after them. So a request whose prompt is an earlier request's prompt and output (a
chat's next turn, a search round continuing a reasoning chain) computes only the tokens after them, and a request
re-admitted after preemption finds its own generated blocks again. Freed blocks keep their content and name until a
new allocation needs them: blocks with no name are reused first, then named ones least recently freed first (vLLM's
policy). RAG prompts share long
prefixes (instructions, few-shot demonstrations), so this skips most of their prompt work.

Only generation requests take part: an embedding's final chunk writes no KV at all. A generation under a LoRA adapter
computes other K and V for the same tokens, so its chain starts from the adapter's slot: its blocks are found only by
requests under the same adapter, never by the base model's or another adapter's. At least the prompt's last token is
always computed (its logits are needed).

Held blocks: a finished generation that may be continued (`SamplingParams.hold_kv_s`, engine/continuation.py) keeps
its named blocks pinned under its id until a deadline, so nothing evicts them meanwhile; its continuation (a request
under the same id, or any request that matched every held block, as a continuation over HTTP does under a new id)
drops the hold once it has matched the blocks itself, and `release_hold` drops one nobody will continue. Holds are
bounded: past the deadline, or as soon as serving work finds too few free blocks (`reclaim`: oldest hold first, only
when dropping frees enough; bulk work never takes them), they are released, and a late continuation finds what is
still cached and recomputes the rest.
"""

from __future__ import annotations

import hashlib
import heapq
from array import array
from collections import OrderedDict, deque

from orthrus_rag.engine.core.request import Request


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def num_blocks_needed(self, req: Request, num_new_tokens: int) -> int:
        """Additional blocks `req` needs so that this step's tokens have KV slots."""
        num_tokens = req.num_kv_tokens_after(num_new_tokens)
        total = -(-num_tokens // self.block_size)
        return max(0, total - len(req.block_table))

    def can_allocate(self, req: Request, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(req, num_new_tokens) <= len(self.free_blocks)

    def allocate(self, req: Request, num_new_tokens: int) -> None:
        needed = self.num_blocks_needed(req, num_new_tokens)
        assert needed <= len(self.free_blocks), "allocate() without can_allocate()"
        for _ in range(needed):
            req.block_table.append(self._take())

    def trim(self, req: Request, num_new_tokens: int) -> None:
        """Return blocks beyond what this step needs (a chunk grown into an embedding's final chunk writes no
        KV, so the blocks taken for it are not needed)."""
        keep = -(-req.num_kv_tokens_after(num_new_tokens) // self.block_size)
        while len(req.block_table) > keep:
            self._release(req.block_table.pop())

    def free(self, req: Request) -> None:
        for block in reversed(req.block_table):  # NOTE: tail first: a prefix cache evicts a prompt's end first
            self._release(block)
        req.block_table = []

    # ---- prefix caching (PrefixCachingBlockManager); without it nothing is shared ------------------------------
    def match_prefix(self, req: Request) -> int:
        """Give a request about to start the cached blocks of its prompt's longest cached prefix; the tokens it
        need not compute."""
        return 0

    def unmatch(self, req: Request) -> None:
        """Undo `match_prefix` for a request that could not start after all."""

    def cache_computed(self, req: Request) -> None:
        """Record the blocks of `req`'s tokens that are now full and computed."""

    def hold(self, key: str, req: Request, until: float) -> None:
        """Pin `req`'s named blocks under `key` until `until` (call before `free(req)`)."""

    def expire_holds(self, now: float) -> None:
        """Release the holds whose deadline has passed."""

    def release_hold(self, key: str) -> bool:
        """Drop the hold under `key` now (a generation nobody will continue); whether there was one."""
        return False

    def reclaim(self, req: Request, num_new_tokens: int) -> None:
        """Release holds (oldest first) so that serving work `req` finds its blocks, if dropping them frees enough."""

    def _take(self) -> int:
        return self.free_blocks.popleft()

    def _release(self, block: int) -> None:
        self.free_blocks.append(block)


class PrefixCachingBlockManager(BlockManager):
    def __init__(self, num_blocks: int, block_size: int) -> None:
        super().__init__(num_blocks, block_size)
        # NOTE: an ordered set: reuse from the front, cached blocks wait at the back, any block can leave
        self.free_blocks = OrderedDict.fromkeys(range(num_blocks))  # type: ignore[assignment]
        self.ref_counts = [0] * num_blocks
        self.name_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}
        self.num_hit_tokens = 0  # prompt tokens served from the cache so far (first admissions only)
        self.holds: OrderedDict[str, tuple[list[int], float]] = OrderedDict()  # key -> (pinned blocks, deadline)
        self._deadlines: list[tuple[float, int, str]] = []  # a heap (deadline, serial, key); stale entries skipped
        self._hold_tails: dict[int, str] = {}  # a hold's last block -> its key
        self._serial = 0

    def block_names(self, req: Request, num_blocks: int) -> list[bytes]:
        """Names of the first `num_blocks` full blocks of `req`'s tokens (prompt, then output), each computed once
        per request as the sequence grows."""
        names = req.block_names
        if len(names) < num_blocks:
            bs = self.block_size
            parent = names[-1] if names else (b"adapter:%d" % req.adapter_slot if req.adapter_slot else b"")
            for i in range(len(names), num_blocks):
                parent = hashlib.sha256(parent + array("q", req.token_ids_slice(i * bs, (i + 1) * bs)).tobytes()
                                        ).digest()
                names.append(parent)
        return names

    def match_prefix(self, req: Request) -> int:
        if not req.shares_prefixes or req.num_computed_tokens or req.block_table:
            return 0
        if req.sampling_params is not None and req.sampling_params.prompt_logprobs is not None:
            return 0  # NOTE: its prompt log-probabilities come from computing every prompt row
        # NOTE: the last token is always computed; a re-admitted victim's own output blocks count too
        limit = (req.num_tokens - 1) // self.block_size
        for name in self.block_names(req, limit):
            block = self.block_of.get(name)
            if block is None:
                break
            self._ref(block)
            req.block_table.append(block)
        req.num_computed_tokens = len(req.block_table) * self.block_size
        req.num_registered_blocks = len(req.block_table)
        if not req.num_preemptions:  # NOTE: a re-admitted victim finding its own blocks again is no new hit
            self.num_hit_tokens += req.num_computed_tokens
            req.num_cached_tokens = req.num_computed_tokens
        # NOTE: a continuation's held blocks are now its own: its id's hold, and any hold whose last block it matched
        # (the name chain: then it matched all of them); a scored pair continues no generation
        if not req.is_embed:
            self._drop_hold(req.req_id)
        if self._hold_tails and not req.is_embed:
            for block in req.block_table:
                key = self._hold_tails.get(block)
                if key is not None:
                    self._drop_hold(key)
        return req.num_computed_tokens

    def unmatch(self, req: Request) -> None:
        if not req.num_preemptions:
            self.num_hit_tokens -= req.num_computed_tokens
            req.num_cached_tokens = 0
        self.free(req)
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0

    def cache_computed(self, req: Request) -> None:
        if not req.shares_prefixes:
            return
        full = req.num_computed_tokens // self.block_size
        if full <= req.num_registered_blocks:
            return
        names = self.block_names(req, full)
        for i in range(req.num_registered_blocks, full):
            block, name = req.block_table[i], names[i]
            if name not in self.block_of and block not in self.name_of:  # another request may have named it first
                self.block_of[name] = block
                self.name_of[block] = name
        req.num_registered_blocks = full

    # ---- holds ------------------------------------------------------------------------------------------------
    def hold(self, key: str, req: Request, until: float) -> None:
        self._drop_hold(key)  # NOTE: an id reused for a new request replaces what the old one held
        blocks = []
        # NOTE: by name: where another request had named a block of the same content first, that one is found
        for name in req.block_names[:req.num_registered_blocks]:
            block = self.block_of.get(name)
            if block is None:
                break
            self._ref(block)
            blocks.append(block)
        if blocks:
            self.holds[key] = (blocks, until)
            self._hold_tails[blocks[-1]] = key
            self._serial += 1
            heapq.heappush(self._deadlines, (until, self._serial, key))

    def expire_holds(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            until, _, key = heapq.heappop(self._deadlines)
            held = self.holds.get(key)
            if held is not None and held[1] == until:  # NOTE: else dropped or replaced since (a stale entry)
                self._drop_hold(key)
        if not self.holds:
            self._deadlines.clear()

    def release_hold(self, key: str) -> bool:
        found = key in self.holds
        self._drop_hold(key)
        return found

    def reclaim(self, req: Request, num_new_tokens: int) -> None:
        if not self.holds:  # NOTE: first: this runs for every scheduled serving request of every step
            return
        short = self.num_blocks_needed(req, num_new_tokens) - len(self.free_blocks)
        if short <= 0:
            return
        # NOTE: a held block another request also uses frees nothing when its hold goes
        freeable = sum(1 for blocks, _ in self.holds.values() for b in blocks if self.ref_counts[b] == 1)
        if freeable < short:
            return  # NOTE: dropping every hold would not be enough: keep them, the caller preempts instead
        while len(self.free_blocks) < self.num_blocks_needed(req, num_new_tokens) and self.holds:
            self._drop_hold(next(iter(self.holds)))

    def _drop_hold(self, key: str) -> None:
        blocks, _ = self.holds.pop(key, ([], 0.0))
        if blocks and self._hold_tails.get(blocks[-1]) == key:
            del self._hold_tails[blocks[-1]]
        for block in reversed(blocks):
            self._release(block)

    def _ref(self, block: int) -> None:
        """One more owner of a cached block (out of the free list if it was there)."""
        if self.ref_counts[block] == 0:
            del self.free_blocks[block]
        self.ref_counts[block] += 1

    def _take(self) -> int:
        block, _ = self.free_blocks.popitem(last=False)  # type: ignore[call-arg]
        name = self.name_of.pop(block, None)
        if name is not None:  # evicted: its content is about to be overwritten
            del self.block_of[name]
        self.ref_counts[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        assert self.ref_counts[block] >= 0, f"block {block} released more often than taken"
        if self.ref_counts[block] == 0:
            self.free_blocks[block] = None  # type: ignore[index]
            if block not in self.name_of:  # nothing worth keeping: reuse it first
                self.free_blocks.move_to_end(block, last=False)  # type: ignore[attr-defined]
