"""Tokenizer built with `tokenizers` from GGUF metadata or a tokenizer.json, plus chat template."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from streamgrok.errors import ModelLoadError

# Pre-tokenizer split patterns by GGUF `tokenizer.ggml.pre`, as llama.cpp defines them.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_END_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end_of_text|>", "<|endoftext|>", "</s>", "<|end|>")
_CONTROL, _USER_DEFINED = 3, 4


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in ("smollm", "starcoder", "refact"):
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("gpt2", "default", "gpt-2"):
        return byte_level
    patterns = {"llama-bpe": _LLAMA3_PATTERN, "llama3": _LLAMA3_PATTERN, "qwen2": _QWEN2_PATTERN}
    if pre in patterns:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(patterns[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ModelLoadError(
        f"GGUF pre-tokenizer {pre!r} is not supported (supported: smollm, gpt2, llama-bpe, "
        "qwen2); load the model's Hugging Face folder, which carries tokenizer.json"
    )


@dataclass
class Tokenizer:
    """Text <-> token ids, special tokens, stop tokens and the model's chat template."""

    hf: HFTokenizer
    bos_id: int | None
    eos_id: int
    stop_ids: frozenset[int]
    chat_template: str | None = None
    add_bos: bool = False
    _template_cache: Any = field(default=None, repr=False)
    _typed_parts: bool = field(default=False, repr=False)  # content as a list of parts
    _line_breaks: frozenset[int] | None = field(default=None, repr=False)

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any]) -> Tokenizer:
        """Build a byte-level BPE tokenizer from `tokenizer.ggml.*` metadata."""
        kind = meta.get("tokenizer.ggml.model")
        if kind != "gpt2":
            raise ModelLoadError(
                f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2'); "
                "load the model's Hugging Face folder instead"
            )
        tokens: list[str] = meta["tokenizer.ggml.tokens"]
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
        hf = HFTokenizer(
            models.BPE(
                vocab={t: i for i, t in enumerate(tokens)},
                merges=merges,
                fuse_unk=False,
                byte_fallback=False,
            )
        )
        hf.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre") or "default")
        hf.decoder = decoders.ByteLevel()
        types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
        hf.add_special_tokens(
            [AddedToken(t, special=True, normalized=False)
             for t, ty in zip(tokens, types) if ty == _CONTROL]
        )
        hf.add_tokens(
            [AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
        )
        eos = int(meta["tokenizer.ggml.eos_token_id"])
        bos = meta.get("tokenizer.ggml.bos_token_id")
        control = {t for t, ty in zip(tokens, types) if ty == _CONTROL}
        return cls(
            hf=hf,
            bos_id=None if bos is None else int(bos),
            eos_id=eos,
            stop_ids=_stop_ids(hf, eos, control),
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        )

    @classmethod
    def from_hf_folder(cls, folder: Path, extra_eos: Sequence[int] = ()) -> Tokenizer:
        """Load tokenizer.json and tokenizer_config.json from a Hugging Face folder."""
        from streamgrok.model.hf_loader import read_json

        path = folder / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"missing file: {path}")
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as exc:
            raise ModelLoadError(f"{path} is not a valid tokenizer: {exc}") from exc
        config = read_json(folder / "tokenizer_config.json") if (
            folder / "tokenizer_config.json"
        ).is_file() else {}

        def token_id(key: str) -> int | None:
            value = config.get(key)
            if isinstance(value, dict):
                value = value.get("content")
            return None if value is None else hf.token_to_id(value)

        eos = token_id("eos_token")
        if eos is None:
            eos = extra_eos[0] if extra_eos else None
        if eos is None:
            raise ModelLoadError(f"{folder}: no eos_token in tokenizer_config.json")
        specials = {t.content for t in hf.get_added_tokens_decoder().values() if t.special}
        stops = _stop_ids(hf, eos, specials) | frozenset(extra_eos)
        template = config.get("chat_template") or _folder_template(folder)
        if isinstance(template, list):
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        return cls(
            hf=hf,
            bos_id=token_id("bos_token"),
            eos_id=eos,
            stop_ids=stops,
            chat_template=template,
            add_bos=bool(config.get("add_bos_token", False)),
        )

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised."""
        ids = self.hf.encode(text, add_special_tokens=False).ids
        if (self.add_bos if add_bos is None else add_bos) and self.bos_id is not None:
            ids = [self.bos_id, *ids]
        return ids

    def line_break_ids(self) -> frozenset[int]:
        """Ids of the tokens whose text holds a line break (stop tokens of one-line
        answers); found once by decoding the vocabulary."""
        if self._line_breaks is None:
            texts = self.hf.decode_batch([[i] for i in range(self.vocab_size)],
                                         skip_special_tokens=True)
            self._line_breaks = frozenset(i for i, t in enumerate(texts) if "\n" in t)
        return self._line_breaks

    def decode(self, ids: Sequence[int], skip_special: bool = True) -> str:
        """Text of token ids (special tokens left out unless asked for)."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special)

    def render_chat(
        self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Render the model's own chat template with jinja2 (sandboxed)."""
        if not self.chat_template:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + (
                "assistant: " if add_generation_prompt else ""
            )
        if self._template_cache is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: date.today().strftime(fmt)
            self._template_cache = env.from_string(self.chat_template)
            self._typed_parts = ("['type']" in self.chat_template
                                 or '["type"]' in self.chat_template)
        if self._typed_parts:  # a vision-language template reads content as typed parts
            messages = [{**m, "content": [{"type": "text", "text": m["content"]}]}
                        if isinstance(m.get("content"), str) else m for m in messages]
        return self._template_cache.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self._token_text(self.bos_id),
            eos_token=self._token_text(self.eos_id),
        )

    def _token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else (self.hf.id_to_token(token_id) or "")


def _folder_template(folder: Path) -> str | None:
    """A chat template kept beside the tokenizer (chat_template.jinja, or the processor's
    chat_template.json, as vision-language folders keep it)."""
    from streamgrok.model.hf_loader import read_json

    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if (folder / "chat_template.json").is_file():
        return read_json(folder / "chat_template.json").get("chat_template")
    return None


def _raise_template_error(message: str) -> None:
    raise TemplateError(message)


def _stop_ids(hf: HFTokenizer, eos: int, specials: set[str]) -> frozenset[int]:
    ids = {eos}
    for marker in _END_MARKERS:
        token_id = hf.token_to_id(marker)
        if token_id is not None and marker in specials:
            ids.add(token_id)
    return frozenset(ids)
