"""Tokenizers: the checkpoint's own (through transformers), or a byte-level one.

Knows: encoding prompts and chat messages, decoding completions, which ids end
a sequence. Dummy models and checkpoints without tokenizer files get
ByteTokenizer: UTF-8 bytes shifted past three special ids.
Does not know: models or generation.
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence

from flexoff.errors import CheckpointError, InputError


class Tokenizer(Protocol):
    eos_ids: tuple[int, ...]

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Sequence[int]) -> str: ...
    def chat(self, messages: list[dict[str, str]], generation_prompt: bool = True) -> list[int]: ...


class HFTokenizer:
    """A Hugging Face tokenizer loaded from local files."""

    def __init__(self, tok: Any, eos_ids: Sequence[int]):
        self.tok = tok
        ids = set(int(i) for i in eos_ids)
        if tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
        self.eos_ids = tuple(sorted(ids))

    @classmethod
    def load(cls, path: str, eos_ids: Sequence[int], gguf_file: str | None = None) -> "HFTokenizer":
        from transformers import AutoTokenizer

        try:
            kw = {"gguf_file": gguf_file} if gguf_file else {}
            return cls(AutoTokenizer.from_pretrained(path, **kw), eos_ids)
        except Exception as e:  # transformers raises many types for bad files
            raise CheckpointError(f"cannot load the tokenizer from {path}: {str(e).splitlines()[0]}") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tok(text).input_ids)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def chat(self, messages: list[dict[str, str]], generation_prompt: bool = True) -> list[int]:
        """The chat through the model's template, ending with the assistant's prompt (for
        generating) or not (for training on the chat as it is)."""
        if not getattr(self.tok, "chat_template", None):
            raise InputError("this model's tokenizer has no chat template; send a plain 'prompt' instead")
        out = self.tok.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
        if hasattr(out, "keys"):
            out = out["input_ids"]
        return list(out)


class ByteTokenizer:
    """UTF-8 bytes as ids 3..258; 0 pad, 1 bos, 2 eos. Ids past 258 decode to nothing."""

    OFFSET = 3

    def __init__(self, vocab_size: int, eos_ids: Sequence[int] = (2,)):
        if vocab_size < 259:
            raise CheckpointError(f"vocab_size {vocab_size} is too small for the byte tokenizer (needs 259)")
        self.eos_ids = tuple(eos_ids)

    def encode(self, text: str) -> list[int]:
        return [1] + [b + self.OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int]) -> str:
        data = bytes(i - self.OFFSET for i in ids if self.OFFSET <= i < 256 + self.OFFSET)
        return data.decode("utf-8", errors="replace")

    def chat(self, messages: list[dict[str, str]], generation_prompt: bool = True) -> list[int]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant: " if generation_prompt else "")
        return self.encode(text)
