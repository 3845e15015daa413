"""Text <-> token ids: an HF `tokenizer.json` through the `tokenizers` library, the chat
template from `tokenizer_config.json` (Jinja), and incremental detokenization for streaming.
"""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

log = logging.getLogger(__name__)


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE (GPT-2, Llama 3, Qwen) writes each byte of a token as one printable
    character: the bytes that are printable Latin-1 as themselves, the other 68 as chr(256 + i)
    in byte order. Character -> byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    others = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(others)}}


_BYTE_LEVEL = _byte_level_alphabet()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte pieces: "<0xE6>"


def _token_text(value) -> str | None:
    """tokenizer_config.json stores special tokens as "<s>" or {"content": "<s>", ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def check_tokenizer(path: str | Path) -> None:
    """ValueError unless the tokenizer of the model folder `path`, if it has a tokenizer.json,
    loads (the CLI's check before a server starts)."""
    if (Path(path) / "tokenizer.json").is_file():
        Tokenizer(path)


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _HFTokenizer

        path = Path(path)
        try:
            self._tok = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:  # the library raises a bare Exception on a file it cannot parse
            raise ValueError(f"{path / 'tokenizer.json'}: unreadable tokenizer: {e}") from None
        cfg_file = path / "tokenizer_config.json"
        try:
            cfg = json.loads(cfg_file.read_text(encoding="utf-8")) if cfg_file.is_file() else {}
        except ValueError as e:
            raise ValueError(f"{cfg_file}: not JSON: {e}") from None
        if not isinstance(cfg, dict):
            raise ValueError(f"{cfg_file}: not a JSON object")
        map_file = path / "special_tokens_map.json"
        if "added_tokens_decoder" not in cfg and map_file.is_file():
            # A legacy tokenizer_config.json: transformers takes the special tokens of
            # special_tokens_map.json over it.
            try:
                special = json.loads(map_file.read_text(encoding="utf-8"))
            except ValueError as e:
                raise ValueError(f"{map_file}: not JSON: {e}") from None
            if isinstance(special, dict):
                cfg = cfg | {k: special[k] for k in ("bos_token", "eos_token") if special.get(k)}
        self.chat_template: str | None = cfg.get("chat_template")
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        jinja_file = path / "chat_template.jinja"
        if jinja_file.is_file():  # as in transformers, the file wins over tokenizer_config's entry
            self.chat_template = jinja_file.read_text(encoding="utf-8")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        # Special tokens: `decode` skips them, so they add no text wherever they stand.
        self.special_ids = frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch, not encode: the binding's encode holds the GIL for the whole text (8 s
        # for 4.5 million characters, every other thread stopped, the engine's included);
        # encode_batch lets go of it while it works, for ~30 us more on a short text.
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        # Llama-2 style configs ask for BOS here; Llama-3 tokenizer.json adds it itself.
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        """The token's piece as the vocabulary spells it ("Ġfox", "▁fox", "<s>"); None for an
        id it does not have."""
        return self._tok.id_to_token(token_id)

    def token_bytes(self, token_id: int, skip_special_tokens: bool = True) -> bytes:
        """The token's own UTF-8 bytes (OpenAI's logprob `bytes`); none for a special token
        unless `skip_special_tokens` is false. A token that holds part of a
        character decodes alone to "\\ufffd"; its bytes are that part, read from its piece: a
        byte-level piece's characters each stand for a byte, a SentencePiece "<0xE6>" is one."""
        text = self.decode([token_id], skip_special_tokens)
        if "\ufffd" not in text:
            return text.encode()
        piece = self._tok.id_to_token(token_id) or ""
        byte = _BYTE_FALLBACK.fullmatch(piece)
        if byte:
            return bytes([int(byte.group(1), 16)])
        if piece and all(c in _BYTE_LEVEL for c in piece):
            return bytes(_BYTE_LEVEL[c] for c in piece)
        return text.encode()

    def vocabulary_bytes(self) -> list[bytes | None]:
        """Every token's bytes as they stand inside a decoded text, by id (None for a special
        token: it writes no text): what a grammar matches the output against
        (`structured.Grammars`). A byte-level piece's characters each stand for a byte
        ("Ġfox" -> b" fox"); a SentencePiece piece's "▁" is a space ("▁fox" -> b" fox", where
        `token_bytes` gives the first token's text, without it) and "<0xE6>" one byte. An
        added token that is not special goes through the decoder as a piece does ("Ġzz" is
        b" zz" under ByteLevel)."""
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        parts = decoder.get("decoders") or [decoder]
        kinds = {d.get("type") for d in parts if isinstance(d, dict)}
        byte_level = "ByteLevel" in kinds
        byte_fallback = "ByteFallback" in kinds
        # "▁" is a space where the decoder says so (Metaspace, or Replace of it); a byte-level
        # decoder keeps it as the character it is.
        spaces = "Metaspace" in kinds or any(d.get("type") == "Replace" and d.get("pattern") == {"String": "\u2581"}
                                             for d in parts if isinstance(d, dict))
        out: list[bytes | None] = []
        for i in range(self.vocab_size):
            if i in self.special_ids:
                out.append(None)
                continue
            piece = self._tok.id_to_token(i)
            if piece is None:  # a gap in the ids
                out.append(None)
            elif byte_level and all(c in _BYTE_LEVEL for c in piece):
                out.append(bytes(_BYTE_LEVEL[c] for c in piece))
            elif byte_fallback and (byte := _BYTE_FALLBACK.fullmatch(piece)):
                out.append(bytes([int(byte.group(1), 16)]))
            else:
                out.append((piece.replace("\u2581", " ") if spaces else piece).encode())
        return out

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, template_kwargs: dict | None = None,
                            documents: list[dict] | None = None, add_special_tokens: bool = False,
                            tools: list[dict] | None = None) -> list[int]:
        """Token ids of the conversation, rendered as transformers renders it (what vLLM's
        chat endpoint sends the model): the assistant turn's opening unless
        `add_generation_prompt` is false; with `continue_final_message`, the chat cut right
        after the last message's content, so that the reply continues it; `template_kwargs`,
        more variables for the template (vLLM's `chat_template_kwargs`, over the ones named
        here, as there), `documents` its documents, `tools` the tools a reply may call (OpenAI's
        shape); `add_special_tokens`, BOS added when
        tokenizing besides what the template writes (vLLM's chat default: false)."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true")
        if self.chat_template is None:
            return self.encode(plain_chat_prompt(messages, add_generation_prompt))
        if continue_final_message:
            if "content" not in self.chat_template:
                raise ValueError("continue_final_message: the chat template reads no message content")
            messages = [*messages[:-1], {**messages[-1], "content": messages[-1]["content"] + _CONTINUE_TAG}]
        if self._template is None:
            self._template = _template_environment().from_string(self.chat_template)
        variables = dict(add_generation_prompt=add_generation_prompt, tools=tools, documents=documents,
                         bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        variables.update(template_kwargs or {})
        variables["messages"] = messages
        text = self._template.render(**variables)
        if continue_final_message:
            # transformers' rule: cut at the mark; where the template trimmed the space after
            # it, the message's own trailing spaces go too.
            if _CONTINUE_TAG.strip() not in text:
                raise ValueError("continue_final_message: the chat template drops the final message's content")
            at = text.rindex(_CONTINUE_TAG.strip())
            text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
        # The template writes BOS itself when the model wants one.
        return self.encode(text, add_special_tokens=add_special_tokens)


# Appended to the final message for continue_final_message, found in the rendered text and
# cut there (transformers' own mark).
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _raise_template_error(message: str):
    raise ValueError(f"chat template: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' `tojson`: the text as it is (Jinja's own escapes "<", "&", "'" and
    every non-ASCII character, and the prompt would differ from the one the model was
    trained on and vLLM sends)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _template_environment():
    """The Jinja environment chat templates are written for: transformers' (what vLLM renders
    them with), sandboxed, with loop controls ({% break %}, {% continue %}) and the
    {% generation %} block, which renders its body (transformers uses it to find the
    assistant's tokens when training; templates of fine-tuned models carry it)."""
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)  # the "generation" token
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, Generation])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_template_error
    env.globals["strftime_now"] = lambda fmt: time.strftime(fmt)  # Llama 3.2 templates
    return env


def plain_chat_prompt(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The prompt for a tokenizer without a chat template, e.g.
    [{"role": "user", "content": "hi"}] -> "user: hi\\nassistant:" (without the last line
    when `add_generation_prompt` is false: a final assistant message is then continued)."""
    lines = [f"{m['role']}: {m['content']}" for m in messages]
    return "\n".join(lines + (["assistant:"] if add_generation_prompt else []))


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[tuple[int, ...]]:
    """vLLM's bad_words as token sequences: each word encoded without special tokens as it is
    written (its leading whitespace taken off), and once more after a space where that gives
    as many tokens, the first another one (" hello" is one token of its own in BPE
    vocabularies): a word is then banned at the start of the output and within it."""
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not plain:
            continue
        out.append(tuple(plain))
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(tuple(spaced))
    return out


# Prompt tokens the first window starts with (vLLM starts its window on the prompt's last 5).
PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Text of a growing token list, emitted as deltas.

    Decodes a short window (`prefix` .. end) rather than all tokens each step; holds text
    back while it ends in an incomplete UTF-8 sequence ("\\ufffd").

    The first window starts on the prompt's last tokens, so the first output token decodes as
    it reads after the prompt: a SentencePiece decoder (Llama 2, Mistral) drops the leading
    space of the first token it decodes, and "The fox" + "▁jumps" decoded alone would give
    "jumps", glued to the prompt, where vLLM gives " jumps".
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] = (), skip_special_tokens: bool = True):
        self.tok = tokenizer
        # Special tokens' text is left out (vLLM's skip_special_tokens), or kept with False.
        self._skip = skip_special_tokens
        self._special = getattr(tokenizer, "special_ids", frozenset()) if skip_special_tokens else frozenset()
        self.ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT:])  # context, then the output tokens
        self.text = ""
        self._prefix = 0  # window start
        self._read = len(self.ids)  # tokens whose text is in self.text (or, at first, the context's)

    def add(self, token_id: int) -> str:
        if token_id in self._special:
            # No text wherever it stands (decode skips it), and kept out of the window: a run of
            # them (EOS after EOS with ignore_eos, as benchmarks ask) made every later step
            # decode a window as long as the run, each row's cost growing with its output.
            return ""
        self.ids.append(token_id)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before):]
            self.text += delta
            self._prefix, self._read = self._read, len(self.ids)
            return delta
        return ""

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids) if self._skip else self.tok.decode(ids, skip_special_tokens=False)

    def flush(self) -> str:
        """At the end: whatever `add` held back (an incomplete UTF-8 tail decodes as "\ufffd")."""
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        delta = after[len(before):] if len(after) > len(before) else ""
        self.text += delta
        self._prefix, self._read = self._read, len(self.ids)
        return delta
