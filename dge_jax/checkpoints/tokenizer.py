"""Tokenizer and chat template of a checkpoint folder (`tokenizers` + jinja2, no transformers).

Chat templates are rendered the way transformers renders them: a sandboxed jinja2
environment with trim_blocks/lstrip_blocks, `raise_exception`, `strftime_now`, a `tojson`
filter that keeps non-ASCII text, and the special tokens of `tokenizer_config.json` in scope.

How a model is prompted is decided here, once (`prompt_format`, `prompt_renderer`): through
its chat template when its tokenizer has one, else with the raw prompt (a base model: no
template is made up for it).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import pathlib
from collections.abc import Callable
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer

from dge_jax.checkpoints.hf import damaged


class TokenizerError(ValueError):
    """The folder's tokenizer files are missing or unusable."""


class ChatTemplateError(TokenizerError):
    """The chat template does not parse, or refuses the messages (its `raise_exception`)."""


class RaisedByTemplate(jinja2.exceptions.TemplateError):
    """What a chat template's `raise_exception(message)` raises."""


def _raise(message: str):
    raise RaisedByTemplate(message)


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or an AddedToken-like dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    """Encodes, decodes and renders chat prompts for one model."""

    backend: HFTokenizer
    chat_template: str | None
    special_tokens: dict[str, str]
    eos_ids: tuple[int, ...]
    # Where the chat template was read from (named by its errors): a file, or a file's field.
    chat_template_source: str = "the chat template"

    @classmethod
    def from_folder(cls, path: str | pathlib.Path, config: dict | None = None) -> Tokenizer:
        """Reads tokenizer.json, tokenizer_config.json / chat_template.jinja and EOS ids."""
        folder = pathlib.Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(f"{folder} has no tokenizer.json (only fast tokenizers work)")
        try:
            backend = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # tokenizers raises its own type for a cut or bad file
            raise damaged(folder, tok_file, e) from e
        tcfg = _read_json(folder / "tokenizer_config.json")
        template = tcfg.get("chat_template")
        source = f"the chat_template of {folder / 'tokenizer_config.json'}"
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
            source = str(folder / "chat_template.jinja")
        if isinstance(template, list):  # named templates: use "default"
            template = {t["name"]: t["template"] for t in template}.get("default")
        special = {
            k: _token_text(v)
            for k, v in tcfg.items()
            if k.endswith("_token") and _token_text(v) is not None
        }
        eos = _eos_ids(backend, folder, config or _read_json(folder / "config.json"), special)
        return cls(backend, template, special, eos, source)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special tokens written in the text are recognised."""
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Text of `ids` (special tokens dropped by default)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def token_id(self, token: str) -> int | None:
        """The id of a token string, or None if it is not in the vocabulary."""
        return self.backend.token_to_id(token)

    def apply_chat_template(
        self, messages: list[dict[str, str]] | str, add_generation_prompt: bool = True
    ) -> str:
        """The rendered chat prompt; a bare string is one user message."""
        if self.chat_template is None:
            raise TokenizerError("this tokenizer has no chat template; call without --chat")
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = lambda x, indent=None, **kw: json.dumps(
            x, ensure_ascii=False, indent=indent, **kw
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
        fix = "fix the template, or generate without the chat template (no --chat / chat=False)"
        try:
            template = env.from_string(self.chat_template)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise ChatTemplateError(
                f"chat template in {self.chat_template_source} does not parse: line "
                f"{e.lineno}: {e.message}; {fix}"
            ) from e
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except RaisedByTemplate as e:
            raise ChatTemplateError(
                f"chat template in {self.chat_template_source} refused the prompt: {e}; "
                "change the messages as it asks, or generate without the chat template "
                "(no --chat / chat=False)"
            ) from e
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, LookupError) as e:
            raise ChatTemplateError(
                f"chat template in {self.chat_template_source} failed while rendering "
                f"({type(e).__name__}: {e}); {fix}"
            ) from e

    def encode_chat(self, messages: list[dict[str, str]] | str) -> list[int]:
        """Token ids of the rendered chat prompt (the template carries its special tokens)."""
        return self.encode(self.apply_chat_template(messages), add_special_tokens=False)


CHAT_TEMPLATE = "chat template"
RAW_PROMPT = "raw prompt"


def prompt_format(tokenizer) -> str:
    """`CHAT_TEMPLATE` when `tokenizer` (anything with a `chat_template` attribute) has a chat
    template, else `RAW_PROMPT`: a base model is prompted with the text itself."""
    return RAW_PROMPT if getattr(tokenizer, "chat_template", None) is None else CHAT_TEMPLATE


def prompt_renderer(tokenizer) -> Callable[[str], str]:
    """What one prompt becomes before it is tokenized: one user turn of the chat template with
    its generation prompt, or the prompt unchanged without a template (`prompt_format`)."""
    if prompt_format(tokenizer) == RAW_PROMPT:
        return _unchanged
    return tokenizer.apply_chat_template


def _unchanged(text: str) -> str:
    return text


def _read_json(path: pathlib.Path) -> dict:
    """A JSON file's contents ({} when absent); a damaged file says how to replace it."""
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise damaged(path.parent, path, e) from e


def _eos_ids(backend, folder, config, special) -> tuple[int, ...]:
    """EOS ids as transformers' generate uses them: generation_config, else config, else token."""
    for source in (_read_json(folder / "generation_config.json"), config):
        eos = source.get("eos_token_id")
        if eos is not None:
            return tuple(sorted({eos} if isinstance(eos, int) else set(eos)))
    token = special.get("eos_token")
    tid = backend.token_to_id(token) if token else None
    return (tid,) if tid is not None else ()
