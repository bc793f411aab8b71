"""Chained block hashes: deterministic across processes, sensitive to every token and the parent."""

from __future__ import annotations

import subprocess
import sys

from hypothesis import given
from hypothesis import strategies as st

from pdrouter.core.hashing import BlockHasher, hash_blocks, root_hash
from pdrouter.core.tokens import pack_token_ids

from .racing import run_racing

TOKENS = list(range(1000, 1000 + 100))


def test_identical_in_two_separate_processes() -> None:
    code = ("from pdrouter.core.hashing import hash_blocks; "
            "print(','.join(h.hex() for h in hash_blocks(list(range(1000, 1100)), 16, seed=7)))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": str(i), "PATH": ""}).stdout.strip() for i in (1, 2)}
    assert len(outs) == 1
    assert outs.pop() == ",".join(h.hex() for h in hash_blocks(TOKENS, 16, seed=7))


def test_only_full_blocks_are_hashed() -> None:
    hashes = hash_blocks(TOKENS, 16)
    assert len(hashes) == 6  # 100 tokens → 6 full blocks, 4 trailing tokens ignored
    assert hash_blocks(TOKENS[:96], 16) == hashes
    assert hash_blocks(TOKENS[:15], 16) == []
    assert all(len(h) == 16 for h in hashes)


def test_any_token_change_changes_that_block_and_every_later_one() -> None:
    base = hash_blocks(TOKENS, 16)
    changed = list(TOKENS)
    changed[40] += 1  # block 2
    other = hash_blocks(changed, 16)
    assert other[:2] == base[:2]
    assert all(a != b for a, b in zip(other[2:], base[2:], strict=True))


def test_parent_and_seed_matter() -> None:
    hasher = BlockHasher(16, seed=0)
    block = TOKENS[:16]
    assert hasher.hash_block(None, block) == hasher.hash_blocks(block)[0]
    assert hasher.hash_block(root_hash(1), block) != hasher.hash_block(None, block)
    assert hash_blocks(TOKENS, 16, seed=1) != hash_blocks(TOKENS, 16, seed=2)
    assert hash_blocks(TOKENS, 16, seed="model-a") != hash_blocks(TOKENS, 16, seed="model-b")


def test_chain_can_be_continued() -> None:
    hasher = BlockHasher(16)
    full = hasher.hash_blocks(TOKENS)
    first = hasher.hash_blocks(TOKENS[:32])
    rest = hasher.hash_blocks(TOKENS[32:], parent=first[-1])
    assert first + rest == full


def test_block_size_changes_the_blocks() -> None:
    assert hash_blocks(TOKENS, 32)[0] != hash_blocks(TOKENS, 16)[1]


@given(st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=200), st.integers(1, 64))
def test_prefix_property(tokens: list[int], block_size: int) -> None:
    hashes = hash_blocks(tokens, block_size)
    assert len(hashes) == len(tokens) // block_size
    cut = len(tokens) // 2
    assert hash_blocks(tokens[:cut], block_size) == hashes[: cut // block_size]


def test_salted_prompts_share_no_block_and_one_salt_shares_them_all() -> None:
    plain = hash_blocks(TOKENS, 16)
    a1, a2 = hash_blocks(TOKENS, 16, salt=b"tenant-a"), hash_blocks(TOKENS, 16, salt=b"tenant-a")
    b = hash_blocks(TOKENS, 16, salt=b"tenant-b")
    assert a1 == a2
    assert not set(a1) & set(b) and not set(a1) & set(plain) and not set(b) & set(plain)
    assert hash_blocks(TOKENS, 16, salt=b"") == plain
    hasher = BlockHasher(16)
    assert hasher.salted_root(b"") is None
    assert hasher.salted_root(b"x") not in (hasher.root, root_hash(0))
    # A salted chain is an ordinary chain on its own root: continuing it gives the same hashes.
    assert hasher.hash_blocks(TOKENS[32:], a1[1]) == a1[2:]


def test_a_request_salt_never_reproduces_a_tenants_part() -> None:
    from pdrouter.core.hashing import cache_salt_key

    assert cache_salt_key(None, None) == b""
    keys = {cache_salt_key("team-a", None), cache_salt_key("team-a", "x"), cache_salt_key(None, "team-a"),
            cache_salt_key(None, "x"), cache_salt_key("team-ax", None), cache_salt_key("team-b", "x")}
    assert len(keys) == 6
    # Whatever a request sends, it cannot land on another tenant's salt: the parts are length-prefixed.
    for forged in ("team-a", "\x06\x00\x00\x00\x00\x00\x00\x00team-a", "a", ""):
        assert cache_salt_key(None, forged or None) != cache_salt_key("team-a", None)
        assert cache_salt_key("team-b", forged or None) != cache_salt_key("team-a", None)


def test_a_packed_prompt_hashes_as_its_ids() -> None:
    hasher = BlockHasher(16, seed=3)
    parent = hasher.salted_root(b"tenant")
    for tokens in (TOKENS, TOKENS[:96], TOKENS[:15], []):
        packed = pack_token_ids(tokens)
        assert hasher.hash_packed(packed) == hasher.hash_blocks(tokens)
        assert hasher.hash_packed(packed, parent) == hasher.hash_blocks(tokens, parent)


def _chained(data: bytes, parent: bytes, block_bytes: int = 64) -> list[bytes]:
    """The hashes spelled out: one XXH3-128 per block of ``data`` over its parent's hash and its bytes."""
    import xxhash

    out = []
    for off in range(0, len(data) // block_bytes * block_bytes, block_bytes):
        parent = xxhash.xxh3_128_digest(parent + data[off:off + block_bytes])
        out.append(parent)
    return out


def test_the_memo_gives_the_hashes_hashing_gives() -> None:
    """Prompts that share prefixes of every length with earlier ones, salted and not, short and past
    the memo's longest prefix: every answer is the chain computed block by block."""
    import random

    from pdrouter.core.hashing import MEMO_ENTRIES, MEMO_MAX_BLOCKS

    rng = random.Random(5)
    hasher = BlockHasher(block_size=16, seed=3)
    salted = hasher.salted_root(b"tenant-a")
    assert salted is not None
    bases = [[rng.randrange(40) for _ in range(rng.randrange(0, 16 * (MEMO_MAX_BLOCKS + 40)))] for _ in range(12)]
    for _ in range(3_000):
        base = rng.choice(bases)
        tokens = base[:rng.randrange(len(base) + 1)] + [rng.randrange(40) for _ in range(rng.randrange(300))]
        data = pack_token_ids(tokens)
        parent = salted if rng.random() < 0.2 else None
        got = hasher.hash_packed(data, parent)
        assert got == _chained(data, hasher.root if parent is None else parent)
        got.append(b"not a hash")  # the caller's list: the memo is not touched
        assert len(hasher._memo) <= MEMO_ENTRIES


def test_a_salted_prompt_never_reuses_an_unsalted_ones_hashes() -> None:
    hasher = BlockHasher(block_size=16)
    data = pack_token_ids(list(range(16 * 10)))
    plain = hasher.hash_packed(data)
    salted = hasher.hash_packed(data, hasher.salted_root(b"s"))
    assert not set(plain) & set(salted)
    assert hasher.hash_packed(data) == plain


def test_threads_sharing_a_hasher_get_the_hashes_hashing_gives() -> None:
    import random

    from pdrouter.core.hashing import MEMO_ENTRIES

    hasher = BlockHasher(block_size=16)
    rng = random.Random(9)
    prompts = [pack_token_ids([rng.randrange(30) for _ in range(16 * rng.randrange(4, 40))])
               for _ in range(MEMO_ENTRIES * 3)]
    expected = {p: _chained(p, hasher.root) for p in prompts}
    errors: list[BaseException] = []

    def hash_many(seed: int) -> None:
        order = random.Random(seed)
        try:
            for _ in range(1_500):
                prompt = order.choice(prompts)
                assert hasher.hash_packed(prompt) == expected[prompt]
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)

    run_racing(hash_many, [(i,) for i in range(4)])
    assert errors == []
