"""Tokenizer and chat template without transformers: the ``tokenizers`` library plus a Jinja2 sandbox."""
from __future__ import annotations

from pathlib import Path

from mirrorsd.errors import GenerationInputError, ManifestError
from mirrorsd.manifest import Manifest, check_inside, read_json_object


class TextCodec:
    """Encodes prompts (chat template applied by default) and decodes generated ids, incrementally if asked."""

    def __init__(self, folder: Path, manifest: Manifest) -> None:
        from tokenizers import Tokenizer

        tok_dir = check_inside(folder, manifest.tokenizer.directory, "tokenizer directory")
        path = tok_dir / "tokenizer.json"
        if not path.is_file():
            raise ManifestError(f"{path} is missing", "the export folder has no tokenizer",
                                "re-export the folder")
        try:
            self.tokenizer = Tokenizer.from_file(str(path))
        except Exception as exc:  # the tokenizers library raises plain Exception for a malformed file
            raise ManifestError(f"{path} is not a tokenizer the tokenizers library can read",
                                f"{type(exc).__name__}: {str(exc)[:200]}", "re-export the folder") from None
        self.info = manifest.tokenizer
        self._special = self._special_tokens(tok_dir)

    @staticmethod
    def _special_tokens(tok_dir: Path) -> dict[str, str]:
        config = tok_dir / "tokenizer_config.json"
        if not config.is_file():
            return {}
        data = read_json_object(config)
        out = {}
        for key in ("bos_token", "eos_token", "pad_token", "unk_token"):
            value = data.get(key)
            out[key] = value.get("content") if isinstance(value, dict) else (value or "")
        return out

    def encode(self, text: str, chat: bool = True, system: str | None = None) -> list[int]:
        for name, value in (("prompt", text), ("system message", system)):
            _require_utf8(name, value)
        if not chat:
            return self.tokenizer.encode(text, add_special_tokens=True).ids
        if not self.info.chat_template:
            raise GenerationInputError("This model has no chat template", "its tokenizer does not define one",
                                       "use raw completion (--raw / chat=False)")
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        rendered = self.render_chat(messages)
        return self.tokenizer.encode(rendered, add_special_tokens=False).ids

    def render_chat(self, messages: list[dict]) -> str:
        """The chat template applied to ``messages``, in a sandbox with time and size limits (chat_template.py)."""
        from mirrorsd.runtime.chat_template import BASE_CHARS, render

        def raise_exception(message):
            raise GenerationInputError("The chat template refused the conversation", message,
                                       "check the roles and order of the messages")

        own = sum(len(str(m.get("content", ""))) for m in messages)
        return render(self.info.chat_template, BASE_CHARS + 2 * own, globals_={"raise_exception": raise_exception},
                      messages=messages, add_generation_prompt=True, **self._special)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _require_utf8(name: str, text: str | None) -> None:
    """Text that cannot be UTF-8 (lone surrogates: bytes a terminal in another encoding passed) is refused."""
    if text is None:
        return
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise GenerationInputError(f"The {name} is not valid UTF-8 text",
                                   f"character {exc.start} cannot be encoded ({text[exc.start:exc.end]!r})",
                                   "pass UTF-8 text (check the terminal's or file's encoding)") from None


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
