"""The checkpoint folder's tokenizer.json, through the `tokenizers` library."""

from __future__ import annotations

import os
from typing import Optional, Sequence

from ouro_jax.config import OuroConfig


class Tokenizer:
    def __init__(self, tok, vocab_size: int):
        self._tok = tok
        if tok.get_vocab_size(with_added_tokens=True) > vocab_size:
            raise ValueError(f"tokenizer has {tok.get_vocab_size(with_added_tokens=True)} tokens "
                             f"but the model's vocab_size is {vocab_size}")

    @classmethod
    def from_folder(cls, folder: str, cfg: OuroConfig) -> Optional["Tokenizer"]:
        path = os.path.join(folder, "tokenizer.json")
        if not os.path.exists(path):
            return None
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tok = HFTokenizer.from_file(path)
        except Exception as e:  # the tokenizers library raises a bare Exception
            raise ValueError(f"{path} is not a readable tokenizer: {e}") from e
        return cls(tok, cfg.vocab_size)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def token_to_id(self, token: str) -> Optional[int]:
        return self._tok.token_to_id(token)

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)
