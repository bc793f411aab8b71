"""vLLM's KV cache as a transfer pool: one backing allocation, one page per (layer, block).

vLLM allocates the whole KV cache of a worker as one buffer and hands the connector a view per
attention layer, in manager blocks: ``view[block]`` is that block's page, K and V of every head
and slot of the layer together, in the attention backend's own order (on the CPU backend
``[kv_heads, block_size, 2 × head_dim]``). A transfer between two vLLM engines moves pages as
they are: both ends run the same backend with the same geometry (the compat hash says so), so
the bytes need no reordering. A frame's payload is, layer by layer, each run of consecutive
blocks as one range when the blocks' pages are adjacent (they are, in vLLM's layer-major
layouts), else page by page.

The pool never allocates or copies: its ranges are views of vLLM's tensors.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import xxhash

from pdrouter.core.errors import ConfigError
from pdrouter.core.kv_layout import KvLayout
from pdrouter.transfer.frame_plan import FrameSpan
from pdrouter.transfer.pool_bytes import PoolBytes
from pdrouter.transfer.pool_view import PoolView

ARRANGEMENT_PREFIX = "vllm-pages/v1"


@dataclass(frozen=True)
class PagedKvLayout(KvLayout):
    """A ``KvLayout`` whose bytes are arranged as vLLM's backend arranges them.

    ``arrangement`` names that order (backend, layout, page shape and strides); it enters the
    compat hash, so a vLLM pool never exchanges blocks with the project's own engine, nor with a
    vLLM pool whose pages are laid out otherwise.
    """

    arrangement: str = ""

    def compat_hash(self) -> str:
        key = (f"{ARRANGEMENT_PREFIX}|{self.arrangement}|{self.num_layers}|{self.num_kv_heads}|{self.head_dim}|"
               f"{self.block_size}|{self.dtype}")
        return xxhash.xxh3_64_hexdigest(key.encode())


@dataclass(frozen=True)
class _LayerPages:
    offset: int
    """Byte offset of the layer's block 0 in the backing allocation."""
    block_stride: int
    """Bytes from one block's page to the next one's."""


class PagedPool(PoolView):
    """vLLM's per-layer KV views (in layer order) as one transfer pool.

    Every view must be ``[num_blocks, ...page]`` over the same storage, each page contiguous and
    ``layout.block_bytes_per_layer`` long.
    """

    def __init__(self, layers: Sequence[torch.Tensor], layout: PagedKvLayout) -> None:
        if len(layers) != layout.num_layers:
            raise ConfigError(f"{len(layers)} KV layer views for a layout of {layout.num_layers} layers")
        first = layers[0]
        storage = first.untyped_storage()
        page = layout.block_bytes_per_layer
        pages = []
        for index, view in enumerate(layers):
            if view.untyped_storage().data_ptr() != storage.data_ptr():
                raise ConfigError(f"KV layer {index} is not in the same allocation as layer 0")
            if view.shape[0] != layout.num_blocks:
                raise ConfigError(f"KV layer {index} has {view.shape[0]} blocks, the layout says {layout.num_blocks}")
            if not view[0].is_contiguous():
                raise ConfigError(f"KV layer {index}: a block's page is not contiguous (strides {view.stride()})")
            elem = view.element_size()
            if view[0].numel() * elem != page:
                raise ConfigError(f"KV layer {index}: a page is {view[0].numel() * elem} bytes, the geometry says "
                                  f"{page} (only K and V of full attention move; MLA and other caches do not)")
            pages.append(_LayerPages(int(view.storage_offset()) * elem, int(view.stride(0)) * elem))
        self._pages = tuple(pages)
        self._layers = tuple(layers)
        self.pool = torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage)
        self._bytes = self.pool
        PoolBytes.__init__(self, layout, None, is_cuda=first.is_cuda)
        end = max(p.offset + (layout.num_blocks - 1) * p.block_stride + page for p in pages)
        if end > storage.nbytes():
            raise ConfigError(f"KV layer views reach byte {end} of a {storage.nbytes()}-byte allocation")
        if not first.is_cuda:
            self._memory = self.pool.numpy().data

    def finite(self, block_ids: Sequence[int]) -> bool:
        """Whether every value of these blocks, in every layer, is finite (received KV is checked before
        vLLM computes from it: a NaN or an infinity would spoil the request's tokens)."""
        if not block_ids:
            return True
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self._layers[0].device)
        return all(bool(torch.isfinite(view.index_select(0, index)).all()) for view in self._layers)

    def pieces(self, span: FrameSpan) -> Iterator[tuple[int, int]]:
        page = self.layout.block_bytes_per_layer
        for layer in range(span.layer_start, span.layer_end):
            offset, stride = self._pages[layer].offset, self._pages[layer].block_stride
            for start, count in span.runs:
                if stride == page:
                    yield offset + start * stride, count * page
                else:
                    for block in range(start, start + count):
                        yield offset + block * stride, page
