"""Tokenizers: the embedded byte-level one, or a checkpoint's tokenizer.json.

The byte-level tokenizer maps byte b to id b + 3, leaving DeepSeek's special ids 0 (begin of sentence),
1 (end of sentence) and 2 (padding, also Engram's pad) for their usual meaning. A checkpoint folder
that brings a tokenizer.json is read with the `tokenizers` package when it is installed.
"""
from __future__ import annotations

from pathlib import Path

BOS, EOS, PAD = 0, 1, 2


class ByteTokenizer:
    eos_token_id = EOS

    def encode(self, text: str) -> list[int]:
        return [b + 3 for b in text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i - 3 for i in ids if 3 <= i < 259).decode("utf-8", errors="replace")


class TokenizerError(ValueError):
    """A tokenizer.json that cannot be used; the message is one sentence."""


class HFTokenizer:
    """A tokenizer.json, through the `tokenizers` package."""

    def __init__(self, path: Path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError(f"{path} needs the tokenizers package: pip install tokenizers.") from None
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers package raises its own exception type, with a long message
            why = str(e).splitlines()[0].rstrip(".") if str(e) else type(e).__name__
            raise TokenizerError(f"cannot read {path}: {why}.") from None
        self.eos_token_id = self.tok.token_to_id("<｜end▁of▁sentence｜>")
        if self.eos_token_id is None:
            self.eos_token_id = EOS

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)


def load_tokenizer(model: str):
    path = Path(model) / "tokenizer.json"
    return HFTokenizer(path) if path.is_file() else ByteTokenizer()
