"""The one tokenizer of `bench`'s text data and `train`'s: a local Hugging Face tokenizer directory, nothing downloaded.

Text is encoded by the `tokenizers` package from tokenizer.json, without the tokenizer's own special tokens (a BOS),
and a document ends with the EOS token: tokenizer_config.json's (or special_tokens_map.json's) `eos_token`, else the
first of EOS_NAMES the vocabulary holds. Chat data is rendered with the tokenizer's chat template by `transformers`,
the optional extra `chat` (pip install 'megatrain[chat]'), imported only when chat data is read: everything else
needs no `transformers`.
"""

from __future__ import annotations

import json
from pathlib import Path

EOS_NAMES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
# the files of a tokenizer directory that decide its tokens: this reader's, and those transformers reads for chat
TOKEN_FILES = ("tokenizer.json", *CONFIG_FILES, "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
CHAT_TEMPLATES_DIR = "additional_chat_templates"  # transformers' folder of named chat templates, NAME.jinja
DEFAULT_TEMPLATE = "default"  # of several named templates, the one transformers renders a conversation without tools


def token_files(path: str | Path) -> list[str]:
    """The files of tokenizer directory `path` that decide its tokens and chat, by their names under it: those of
    TOKEN_FILES it holds, then each named chat template (CHAT_TEMPLATES_DIR/NAME.jinja), which transformers reads as
    it reads chat_template.jinja (a resume fingerprints them, an export copies them)."""
    path = Path(path)
    named = sorted(f.relative_to(path).as_posix() for f in (path / CHAT_TEMPLATES_DIR).glob("*.jinja") if f.is_file())
    return [name for name in TOKEN_FILES if (path / name).is_file()] + named


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as Backend

        self.path = Path(path)
        if not (self.path / "tokenizer.json").exists():
            raise ValueError(f"--tokenizer {path}: no tokenizer.json there (a local Hugging Face tokenizer directory)")
        try:
            self.backend = Backend.from_file(str(self.path / "tokenizer.json"))
        except Exception as exc:  # the tokenizers package raises a bare Exception for any file it cannot parse
            raise ValueError(f"{self.path / 'tokenizer.json'} is not a tokenizer the tokenizers package reads "
                             f"({exc})") from None
        eos = self._eos_name()
        self.eos = self.backend.token_to_id(eos) if eos else None
        if eos and self.eos is None:  # named by a config file (the fallback names are the vocabulary's)
            raise ValueError(f"{self.path}: its eos_token {eos!r} is no token of its tokenizer.json, so no document "
                             "would end with it: name one the vocabulary holds")
        self._chat = None  # the transformers tokenizer, loaded by the first chat

    def _eos_name(self) -> str | None:
        for name in CONFIG_FILES:
            file = self.path / name
            try:
                config = json.loads(file.read_bytes()) if file.exists() else {}
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
                raise ValueError(f"{file} is not valid JSON ({exc})") from None
            except OSError as exc:  # a folder, a file this user cannot read
                raise ValueError(f"{file} cannot be read ({exc.strerror})") from None
            eos = config.get("eos_token") if isinstance(config, dict) else None
            if eos:
                name = eos.get("content") if isinstance(eos, dict) else eos
                if not isinstance(name, str):
                    raise ValueError(f"{file}: eos_token must be a token (a string, or an object with its content), "
                                     f"got {json.dumps(eos)[:60]}")
                return name
        return next((t for t in EOS_NAMES if self.backend.token_to_id(t) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def document(self, text: str) -> list[int]:
        """A document's tokens: the text's, then EOS (where the tokenizer has one)."""
        return self.encode(text) + ([self.eos] if self.eos is not None else [])

    def token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def chat(self, messages: list[dict]) -> tuple[list[int], list[bool]]:
        """A conversation's tokens and which are the assistant's: each assistant turn's tokens are the difference
        between the rendering up to it and the rendering before it with the generation prompt."""
        ids: list[int] = []
        assistant: list[bool] = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prompt = self._render(messages[:i], generation_prompt=True)
            full = self._render(messages[:i + 1], generation_prompt=False)
            if prompt[:len(ids)] != ids or full[:len(prompt)] != prompt:
                raise ValueError(f"{self.path}: the chat template does not render conversations prefix by prefix; "
                                 "its assistant tokens cannot be told apart")
            assistant += [False] * (len(prompt) - len(ids)) + [True] * (len(full) - len(prompt))
            ids = full
        full = self._render(messages, generation_prompt=False)
        return full, assistant + [False] * (len(full) - len(ids))

    def _render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        if not messages:
            return []
        template = self._template()
        from jinja2 import TemplateError  # transformers' own dependency, which renders the template

        try:
            text = template.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        except (TemplateError, ArithmeticError, LookupError, TypeError, ValueError, RecursionError) as exc:
            # what a template's code raises (sandboxed): a syntax error, a sandbox violation or its range limit, its
            # raise_exception, an {% include %} (no loader), nesting too deep to parse, its arithmetic
            raise ValueError(f"the chat template of {self.path} fails on this conversation ({type(exc).__name__}: "
                             f"{exc})") from None
        return self.encode(text)

    def _template(self):
        if self._chat is None:
            try:
                from transformers import AutoTokenizer
            except ImportError:
                raise ValueError(f"{self.path}: megatrain renders chat data with the tokenizer's chat template through "
                                 "transformers, which is not installed: pip install 'megatrain[chat]'") from None
            try:
                self._chat = AutoTokenizer.from_pretrained(str(self.path), local_files_only=True)
            except Exception as exc:  # transformers raises what its parsing of each file meets
                raise ValueError(f"{self.path}: transformers cannot load it to render chat data ({type(exc).__name__}: "
                                 f"{exc})") from None
            template = self._chat.chat_template
            if not template:
                raise ValueError(f"{self.path}: the tokenizer has no chat template (tokenizer_config.json); "
                                 "chat data needs one")
            if isinstance(template, dict):  # several, by name: transformers renders conversations with the default
                if DEFAULT_TEMPLATE not in template:
                    raise ValueError(f"{self.path}: its chat templates are named {', '.join(map(str, template))}, "
                                     f"and chat data is rendered with the one named {DEFAULT_TEMPLATE!r} (as "
                                     f"transformers renders it): add {CHAT_TEMPLATES_DIR}/{DEFAULT_TEMPLATE}.jinja")
                template = template[DEFAULT_TEMPLATE]
            if not isinstance(template, str):
                raise ValueError(f"{self.path}: its chat template must be a Jinja template (a string), got "
                                 f"{json.dumps(template, default=str)[:60]}")
        return self._chat
