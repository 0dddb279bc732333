"""Paged-attention kernels for the Ouro engine: Pallas (Triton lowering) and plain-JAX references.

    paged_decode_attention(q [B,H,hd], k_cache, v_cache, entry, block_tables, kv_lens)
    paged_decode_attention_qkv(qkv [B,H+2KVH,hd], k_cache, v_cache, entry, block_tables,
                               kv_lens, page, slot, rope=(cos, sin))  # writes the new K/V
    ragged_paged_attention(q [N,H,hd], k_cache, v_cache, entry, block_tables, kv_lens, cu_q_lens)
    decode_attention_o(qkv, k_cache, v_cache, entry, block_tables, kv_lens, page, slot, w_o,
                       counters, rope=(cos, sin))  # the decode kernel + o projection, opt-in

Cache layout [E, P, page_size, KVH, head_dim]; see pallas_kernels/reference.py and
docs/kernels.md. The *_reference functions are the oracle and the "xla" backend.
"""

from pallas_kernels.attention_o import decode_attention_o
from pallas_kernels.decode import paged_decode_attention, paged_decode_attention_qkv
from pallas_kernels.ragged import ragged_paged_attention
from pallas_kernels.reference import (paged_decode_attention_reference,
                                      ragged_paged_attention_reference)

__all__ = ["decode_attention_o", "paged_decode_attention", "paged_decode_attention_qkv",
           "ragged_paged_attention", "paged_decode_attention_reference",
           "ragged_paged_attention_reference"]
