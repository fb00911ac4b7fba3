"""Turn a growing list of token ids into text deltas that never split a character."""

from __future__ import annotations

from streamgrok.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids one at a time; get back only complete new text.

    Byte-level BPE tokens may end mid-way through a multi-byte UTF-8 character; such text
    decodes to U+FFFD and is held back until the character completes.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self._prefix_offset : self._read_offset], self.skip_special)
        text = decode(self.ids[self._prefix_offset :], self.skip_special)
        if len(text) <= len(prefix) or text.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.ids)
        return text[len(prefix) :]

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character decodes as U+FFFD)."""
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self._prefix_offset : self._read_offset], self.skip_special)
        text = decode(self.ids[self._prefix_offset :], self.skip_special)
        self._prefix_offset = self._read_offset = len(self.ids)
        return text[len(prefix) :]
