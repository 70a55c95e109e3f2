"""Tokenizer and chat template without transformers: the ``tokenizers`` library plus a Jinja2 sandbox."""
from __future__ import annotations

import json
from pathlib import Path

from mirrorsd.errors import GenerationInputError, ManifestError
from mirrorsd.manifest import Manifest, check_inside


class TextCodec:
    """Encodes prompts (chat template applied by default) and decodes generated ids, incrementally if asked."""

    def __init__(self, folder: Path, manifest: Manifest) -> None:
        from tokenizers import Tokenizer

        tok_dir = check_inside(folder, manifest.tokenizer.directory, "tokenizer directory")
        path = tok_dir / "tokenizer.json"
        if not path.is_file():
            raise ManifestError(f"{path} is missing", "the export folder has no tokenizer",
                                "re-export the folder")
        self.tokenizer = Tokenizer.from_file(str(path))
        self.info = manifest.tokenizer
        self._special = self._special_tokens(tok_dir)

    @staticmethod
    def _special_tokens(tok_dir: Path) -> dict[str, str]:
        config = tok_dir / "tokenizer_config.json"
        if not config.is_file():
            return {}
        data = json.loads(config.read_text(encoding="utf-8"))
        out = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = data.get(key)
            out[key] = value.get("content") if isinstance(value, dict) else (value or "")
        return out

    def encode(self, text: str, chat: bool = True, system: str | None = None) -> list[int]:
        if not chat:
            return self.tokenizer.encode(text, add_special_tokens=True).ids
        if not self.info.chat_template:
            raise GenerationInputError("This model has no chat template", "its tokenizer does not define one",
                                       "use raw completion (--raw / chat=False)")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        rendered = self.render_chat(messages)
        return self.tokenizer.encode(rendered, add_special_tokens=False).ids

    def render_chat(self, messages: list[dict]) -> str:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise GenerationInputError("The chat template refused the conversation", message,
                                       "check the roles and order of the messages")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        template = env.from_string(self.info.chat_template)
        return template.render(messages=messages, add_generation_prompt=True, **self._special)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


class StreamDecoder:
    """Turns a growing list of ids into text pieces without splitting multi-byte characters.

    Each push decodes only the ids since the previous piece, behind the ids of that piece as context (decoders
    that drop the leading space of a decode, like SentencePiece's, need a token before): O(new ids) per push,
    where decoding everything again would make a long stream quadratic.

        ids   [ ... printed ... | context (the last piece's ids) | pending ]
                                ^ start                          ^ done
        piece = decode(ids[start:]) minus decode(ids[start:done])
    """

    def __init__(self, codec: TextCodec) -> None:
        self.codec, self.ids = codec, []
        self._start = self._done = 0
        self._context = ""  # decode(ids[start:done])

    def push(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        text = self.codec.decode(self.ids[self._start:])
        if text.endswith("\ufffd") or len(text) <= len(self._context):  # an incomplete UTF-8 sequence: wait
            return ""
        piece = text[len(self._context):]
        self._start, self._done = self._done, len(self.ids)
        self._context = self.codec.decode(self.ids[self._start:self._done])
        return piece
