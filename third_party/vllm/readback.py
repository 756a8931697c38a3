"""Read a request's KV back from vLLM's paged KV cache, with no block layout assumed.

The CPU attention backend packs a block's interior in an ISA-specific way, so the layout is
learned by writing known values through the backend's own cache-write op
(``layer.impl.do_kv_cache_update``) into a scratch block (``probe_gather_maps``); the maps
then gather any request's K and V out of the cache (``read_kv``). Used by the connector's
worker side to save KV (third_party.vllm.worker). Not runnable by itself.
"""

from __future__ import annotations

from typing import Any

import torch


def probe_gather_maps(layer: Any, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Learn where the cache-write op puts K[h, t, d] and V[h, t, d] inside one block.

    layer: a vLLM attention layer (its ``impl.do_kv_cache_update``); cache: that layer's
    KV cache, [num_blocks, H, block_size, 2 * D]. Writes small integers (exact in
    bf16/fp16/fp32) through the op into a scratch block: pass 1 key = h, pass 2 key = t,
    pass 3 key = d (value = -2 marker), then the same for the value. Returns (pk, pv), int64
    [H, bs, D]: flat offsets inside a block's [H, bs, 2 * D] area. Raises RuntimeError for
    a quantized (fp8) cache or an op whose writes are not a bijection (then save is
    unsupported on this build)."""
    _, H, bs, D2 = cache.shape
    D = D2 // 2
    if cache.dtype not in (torch.bfloat16, torch.float16, torch.float32) or \
            str(getattr(layer.impl, "kv_cache_dtype", "auto")) != "auto":
        raise RuntimeError(f"KV read-back needs an unquantized cache, got {cache.dtype}")
    t_i = torch.arange(bs).view(bs, 1, 1).expand(bs, H, D)
    h_i = torch.arange(H).view(1, H, 1).expand(bs, H, D)
    d_i = torch.arange(D).view(1, 1, D).expand(bs, H, D)
    slots = torch.arange(bs, dtype=torch.int64)
    maps = []
    for which in ("k", "v"):
        coords = []
        for idx in (h_i, t_i, d_i):
            scratch = torch.full((1, H, bs, D2), -1.0, dtype=cache.dtype)
            val = idx.to(cache.dtype).contiguous()
            other = torch.full((bs, H, D), -2.0, dtype=cache.dtype)
            kk, vv = (val, other) if which == "k" else (other, val)
            layer.impl.do_kv_cache_update(layer, kk, vv, scratch, slots)
            coords.append(scratch.reshape(-1).float())
        # positions holding this tensor: not -1 (unwritten) and not -2 (the other one)
        pos = torch.nonzero((coords[0] >= 0)).flatten()
        if pos.numel() != H * bs * D:
            raise RuntimeError(f"cache-write op wrote {pos.numel()} {which} values, "
                               f"expected {H * bs * D}")
        h, t, d = (coords[j][pos].long() for j in range(3))
        m = torch.full((H, bs, D), -1, dtype=torch.int64)
        m[h, t, d] = pos
        if (m < 0).any():
            raise RuntimeError("cache-write op layout is not a bijection; cannot read back")
        maps.append(m)
    return maps[0], maps[1]


def read_kv(caches: list[torch.Tensor], maps: tuple[torch.Tensor, torch.Tensor],
            block_ids: list[int], block_size: int, num_tokens: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of tokens [0, num_tokens) of a request: [L, T, H, D] in the cache dtype.

    caches: every attention layer's KV cache in layer order; maps: probe_gather_maps's
    (pk, pv); block_ids: the request's blocks in order; block_size: tokens per block of
    the scheduler's block table (a multiple of the kernel's block size)."""
    pk, pv = maps
    H, kbs, D = pk.shape
    nb = -(-num_tokens // block_size)
    r = block_size // kbs  # kernel blocks per scheduler block (1 on this build)
    kb = torch.tensor([b * r + j for b in block_ids[:nb] for j in range(r)], dtype=torch.int64)
    ks, vs = [], []
    for cache in caches:
        blocks = cache.view(-1, H, kbs, 2 * D)[kb].reshape(len(kb), -1)  # [nkb, H*kbs*2D]
        k = blocks[:, pk.reshape(-1)].view(len(kb), H, kbs, D)
        v = blocks[:, pv.reshape(-1)].view(len(kb), H, kbs, D)
        # [nkb, H, kbs, D] -> [nkb * kbs, H, D]
        ks.append(k.permute(0, 2, 1, 3).reshape(-1, H, D)[:num_tokens])
        vs.append(v.permute(0, 2, 1, 3).reshape(-1, H, D)[:num_tokens])
    return torch.stack(ks).contiguous(), torch.stack(vs).contiguous()
