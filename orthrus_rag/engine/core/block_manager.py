"""Paged KV cache bookkeeping: which physical blocks each request owns. Knows nothing of the model."""

from __future__ import annotations

from collections import deque

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
        """Record the blocks of `req`'s prompt that are now full and computed."""

    def _take(self) -> int:
        return self.free_blocks.popleft()

    def _release(self, block: int) -> None:
        self.free_blocks.append(block)
