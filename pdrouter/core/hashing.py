"""Chained block hashes: the key of the prefix cache and of the router's prefix index.

``h[i] = XXH3-128(h[i-1] ‖ tokens of block i as little-endian uint32)`` with
``h[-1] = XXH3-128("pdrouter-block-v1" ‖ seed)``. A hit on block ``i`` therefore means blocks
``0..i`` all match. Only full blocks are hashed; a trailing partial block has no hash. The result
depends only on the tokens, the block size and the seed, never on the process (no ``hash()``),
so the router and every worker on every machine agree.

**Cache salts.** A request with a cache salt (vLLM's ``cache_salt``, or its tenant's, see
:func:`cache_salt_key`) chains its blocks on a root of its own, ``h[-1] = XXH3-128("pdrouter-salt-v1"
‖ root ‖ salt)`` (:meth:`BlockHasher.salted_root`): every hash of the prompt changes, so prompts
with different salts share no block, in an engine's prefix cache or in the router's index, and a
tenant cannot tell from its own time to first token whether another sent a prompt. The salted
root's input starts with a 16-byte domain where a block's starts with its parent's hash, so no
salt can give a root equal to any block's hash.
"""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Sequence

import xxhash

from pdrouter.core.errors import ConfigError, InvalidRequestError
from pdrouter.core.ids import BlockHash
from pdrouter.core.tokens import pack_token_ids

_DOMAIN = b"pdrouter-block-v1"
_SALT_DOMAIN = b"pdrouter-salt-v1"
MAX_CACHE_SALT_CHARS = 256
"""The longest ``cache_salt`` a request may send."""
_hash128 = xxhash.xxh3_128_digest


def root_hash(seed: int | str | bytes = 0) -> BlockHash:
    """The parent of block 0 for a given seed (e.g. the model's compatibility hash)."""
    if isinstance(seed, int):
        seed_bytes = struct.pack("<q", seed) if -(2**63) <= seed < 2**63 else str(seed).encode()
    elif isinstance(seed, str):
        seed_bytes = seed.encode()
    else:
        seed_bytes = bytes(seed)
    return BlockHash(_hash128(_DOMAIN + seed_bytes))


def cache_salt_key(tenant: str | None, request_salt: str | None) -> bytes:
    """The salt a request's blocks are hashed under: its tenant's part (set by the router from the
    tenants file, never by the request) and its own ``cache_salt``. Empty when it has neither: the
    unsalted chain every request shared before salts existed.

    Each part is length-prefixed, so no request salt can reproduce another tenant's part (a
    request of a tenant without a part of its own and one of tenant ``t`` never meet, whatever
    their ``cache_salt``).
    """
    if not tenant and not request_salt:
        return b""
    t = (tenant or "").encode()
    r = (request_salt or "").encode()
    return struct.pack("<II", len(t), len(r)) + t + r


MEMO_KEY_BLOCKS = 4
"""A prompt of at least this many full blocks is looked up in the hasher's memo by its parent and
these leading blocks (shorter ones are hashed as they come)."""
MEMO_ENTRIES = 64
"""Prompts a hasher remembers: the latest one per distinct start, the oldest start forgotten first."""
MEMO_MAX_BLOCKS = 1024
"""The longest prefix of a prompt remembered (its bytes and its hashes: under 120 KiB an entry)."""


class BlockHasher:
    """Hashes a token sequence's full blocks, each hash chained on its parent's.

    **Memo.** Prompts share long prefixes (a system prompt, a document, a conversation's earlier
    turns), and a router and its workers hash every prompt whole: a 2,200-token prompt is 137 hashes,
    about 17 µs. The hasher keeps the latest prompt of each start (:data:`MEMO_KEY_BLOCKS` blocks
    after the same parent) with its hashes; a prompt with that start reuses the hashes of the
    blocks it shares with it, found by comparing bytes (a binary search over whole blocks), and
    hashes only the rest: 6 µs for the same prompt after another with its prefix. The hashes are a
    function of the bytes, so a reused one is the one hashing would give. Safe to share between
    threads: every entry is one immutable tuple, replaced whole, and a start another thread dropped
    first is simply gone.
    """

    __slots__ = ("_memo", "_root", "block_size", "seed")

    def __init__(self, block_size: int = 16, seed: int | str | bytes = 0) -> None:
        if block_size <= 0:
            raise ConfigError(f"block size must be > 0, got {block_size}")
        self.block_size = block_size
        self.seed = seed
        self._root = root_hash(seed)
        self._memo: dict[bytes, tuple[bytes, tuple[BlockHash, ...]]] = {}

    @property
    def root(self) -> BlockHash:
        return self._root

    def salted_root(self, salt: bytes) -> BlockHash | None:
        """The parent of block 0 for prompts salted with ``salt`` (:func:`cache_salt_key`); None for
        no salt (the unsalted ``root``). Pass it as ``parent`` to :meth:`hash_blocks`."""
        if not salt:
            return None
        return BlockHash(_hash128(_SALT_DOMAIN + self._root + salt))

    def hash_blocks(self, tokens: Sequence[int], parent: BlockHash | None = None) -> list[BlockHash]:
        """Hashes of every full block of ``tokens``; the trailing partial block is ignored.

        ``parent`` continues a chain (the hash of the block just before ``tokens[0]``).
        """
        n_blocks = len(tokens) // self.block_size
        if n_blocks == 0:
            return []
        return self.hash_packed(pack_token_ids(tokens[: n_blocks * self.block_size]), parent)

    def hash_packed(self, data: bytes, parent: BlockHash | None = None) -> list[BlockHash]:
        """``hash_blocks`` of a prompt already packed by ``pack_token_ids`` (4 bytes an id), such as
        the one a request sends its workers: the prompt is packed once for both."""
        step = self.block_size * 4
        prev: bytes = self._root if parent is None else parent
        blocks = len(data) // step
        if blocks < MEMO_KEY_BLOCKS:
            return self._chain(prev, data, 0, blocks)
        memo = self._memo
        key = prev + data[:MEMO_KEY_BLOCKS * step]
        entry = memo.get(key)
        if entry is None:
            hashes = self._chain(prev, data, 0, blocks)
            if len(memo) >= MEMO_ENTRIES:
                with contextlib.suppress(StopIteration, RuntimeError):  # another thread emptied or changed it
                    memo.pop(next(iter(memo)), None)
        else:
            known, known_hashes = entry
            same = min(len(known), blocks * step) // step  # at most this many blocks are shared
            # Compared through a view: ``known.startswith`` reads the prefix in place, where slices of
            # both would copy up to 16 KiB for each of the search's steps.
            with memoryview(data) as view:
                if not known.startswith(view[:same * step]):  # where they part: a search over whole blocks
                    low, high = MEMO_KEY_BLOCKS, same - 1  # the key's blocks are shared; block `same` is not
                    while low < high:
                        middle = (low + high + 1) // 2
                        if known.startswith(view[:middle * step]):
                            low = middle
                        else:
                            high = middle - 1
                    same = low
            hashes = list(known_hashes[:same])
            if same < blocks:
                hashes += self._chain(hashes[-1], data, same, blocks)
            memo.pop(key, None)  # re-inserted last: the oldest start goes first
        kept = min(blocks, MEMO_MAX_BLOCKS)
        # The prompt itself when it is immutable and has no more than the kept blocks (a partial last
        # block is never compared): no copy of it.
        whole = type(data) is bytes and len(data) < (kept + 1) * step
        memo[key] = (data if whole else bytes(data[:kept * step]), tuple(hashes[:kept]))
        return hashes

    def _chain(self, prev: bytes, data: bytes, first: int, last: int) -> list[BlockHash]:
        """The hashes of blocks ``first .. last - 1`` of ``data``, chained on ``prev``."""
        step = self.block_size * 4
        out: list[bytes] = []
        append, h = out.append, _hash128
        for off in range(first * step, last * step, step):
            prev = h(prev + data[off : off + step])
            append(prev)
        return out  # type: ignore[return-value]  # bytes are BlockHash values; no per-item wrap

    def hash_block(self, parent: BlockHash | None, block_tokens: Sequence[int]) -> BlockHash:
        """The hash of one full block given its parent's hash."""
        if len(block_tokens) != self.block_size:
            raise InvalidRequestError(f"a block has {self.block_size} tokens, got {len(block_tokens)}")
        prev = self._root if parent is None else parent
        return BlockHash(_hash128(prev + pack_token_ids(block_tokens)))


def hash_blocks(tokens: Sequence[int], block_size: int = 16, seed: int | str | bytes = 0,
                salt: bytes = b"") -> list[BlockHash]:
    """Convenience: ``BlockHasher(block_size, seed).hash_blocks(tokens)``, chained on the salted
    root when ``salt`` is given."""
    hasher = BlockHasher(block_size, seed)
    return hasher.hash_blocks(tokens, hasher.salted_root(salt))
