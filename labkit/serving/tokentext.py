"""Text in and out of `labkit serve`: how a prompt becomes token ids and a generated token becomes text.

The engine's weights are random, so its token ids mean nothing; what matters to a benchmark client is that
it counts the same tokens the server does. Two sides:

- **Out** (every mode): generated token `t` streams as `" " + WORDS[t % 1024]` (`labkit.serving.wordlist`),
  one chunk per token. Every word is a single token of SmolLM2's tokenizer and a run of them re-tokenizes
  to one token per word, so a client that counts output tokens with SmolLM2's tokenizer (AIPerf
  `--tokenizer`, vLLM's `bench serve`) gets exactly `usage.completion_tokens`. Decoding the engine's own
  ids with a real tokenizer would not: random ids decode to fragments that re-tokenize to other counts.
- **In**: `TokenText("smollm2-135m")` encodes string prompts with SmolLM2's tokenizer and renders chat
  messages with its chat template (as vLLM serving SmolLM2 does), so `usage.prompt_tokens` is what a
  client with that tokenizer counts (plus the template's tokens for chat, as with vLLM). The engine takes
  them folded into the shape's vocabulary (`engine_ids`: `id % vocab`) where it is smaller than the
  tokenizer's 49,152.
- **Ids a client sees** are the tokenizer's, as a vLLM server's are: /tokenize gives the tokenizer's ids
  (not folded), an answer's `token_ids` give each generated token as the tokenizer's id of its word
  (`shown`), `stop_token_ids` are read in the same ids (`engine_stop_ids`), and /detokenize decodes with the
  tokenizer (`decode`), so /tokenize and /detokenize invert each other and an answer's ids give back its text.
  `TokenText(None)` has no tokenizer: a string prompt is its UTF-8 bytes (ids 0-255), which no client's
  tokenizer counts the same; read the prompt count from the usage block (AIPerf: `--use-server-token-count`).

Prompts given as token-id lists are taken as they are in both modes (the engine's ids). Without a tokenizer
the ids a client sees are the engine's: a prompt's bytes, and /detokenize spells generated tokens' words.

**Bounded.** No token covers more than `max_token_bytes` bytes of UTF-8 (the tokenizer's longest vocabulary
entry; 1 without a tokenizer), so `at_least(text)` — the text's UTF-8 length over that — is a lower bound on
its token count, known before tokenizing: a prompt that cannot fit the cache is refused without the work.
Text that is not valid Unicode (a lone surrogate such as `"\\ud800"`, which JSON can carry) is refused
(BadInput) rather than handed to the tokenizer. Encoding goes through the tokenizer's batch call, which
releases the interpreter lock, so a server thread tokenizing a long prompt does not stall the event loop.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..params import BadInput
from .wordlist import WORDS
from ..models.loader import cache_dir, locate_gguf

TOKENIZERS = ("smollm2-135m",)


def piece(token: int) -> str:
    """The text a generated token streams as."""
    return " " + WORDS[token % len(WORDS)]


def tokenizer_dir(name: str) -> Path:
    """A folder with SmolLM2's `tokenizer.json` and chat template: the quality lab's converted checkpoint
    when it exists, else the tokenizer alone, read from the packaged GGUF once (slow: transformers parses
    the whole file) and saved beside it."""
    for d in (cache_dir() / name, cache_dir() / f"{name}-tokenizer"):
        if (d / "tokenizer.json").is_file():
            return d
    gguf = locate_gguf(name)          # one line (ModelNotFound) when the package is missing
    try:
        # transformers is the optional `quality` extra: imported where a Hugging Face model is used
        from transformers import AutoTokenizer
    except ImportError as ex:
        raise BadInput(f"reading {name}'s tokenizer the first time needs transformers: pip install -e '.[quality]'") from ex
    out = cache_dir() / f"{name}-tokenizer"
    tmp = out.with_name(out.name + ".tmp")
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
    tmp.rename(out)
    return out


def _chat_template(folder: Path) -> str | None:
    f = folder / "chat_template.jinja"
    if f.is_file():
        return f.read_text()
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        return json.loads(cfg.read_text()).get("chat_template")
    return None


def utf8_len(text: str, what: str = "prompt") -> int:
    """`text`'s UTF-8 length; BadInput (one line) where it holds a lone surrogate, which no encoder takes."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as ex:
        raise BadInput(f"{what} is not valid Unicode text: a lone surrogate "
                       f"{text[ex.start]!r} at character {ex.start}") from None


class TokenText:
    """Prompt text -> engine ids for a shape with `vocab` ids; `tokenizer` None or one of TOKENIZERS."""

    def __init__(self, tokenizer: str | None, vocab: int):
        self.name, self.vocab = tokenizer, vocab
        self.tok = self.template = self.folder = None
        self.max_token_bytes = 1          # no tokenizer: one token per byte
        self.word_ids: list[int] = []     # the tokenizer's id of each generated word, WORDS' order
        self.n_ids = vocab                # ids /detokenize takes
        if tokenizer is None:
            return
        if tokenizer not in TOKENIZERS:
            raise BadInput(f"unknown tokenizer {tokenizer!r}: choose one of {', '.join(TOKENIZERS)} or none")
        try:
            # tokenizers comes with the optional `quality` extra (transformers)
            import tokenizers
        except ImportError as ex:
            raise BadInput("--tokenizer needs the tokenizers package: pip install -e '.[quality]'") from ex
        self.folder = folder = tokenizer_dir(tokenizer)
        self.tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        # byte-level entries spell one byte per character; their UTF-8 length can only overstate that
        self.max_token_bytes = max(len(k.encode("utf-8")) for k in self.tok.get_vocab(with_added_tokens=True))
        self.n_ids = self.tok.get_vocab_size(with_added_tokens=True)
        words = [e.ids for e in self.tok.encode_batch([" " + w for w in WORDS], add_special_tokens=False)]
        if any(len(w) != 1 for w in words):
            raise BadInput(f"{tokenizer}'s tokenizer does not spell every generated word as one token")
        self.word_ids = [w[0] for w in words]
        self._word_of = {w: k for k, w in enumerate(self.word_ids)}
        src = _chat_template(folder)
        if src:
            # jinja2 comes with the optional `quality` extra (transformers' chat templates)
            from jinja2.sandbox import ImmutableSandboxedEnvironment   # what transformers renders templates with
            self.template = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(src)

    def describe(self) -> str:
        if self.tok is None:
            return "no tokenizer: string prompts count as UTF-8 bytes (use the usage block for prompt tokens)"
        return (f"{self.name}'s tokenizer for prompts (a client's --tokenizer: {self.folder}); "
                f"one SmolLM2 word-token per generated token")

    def engine_ids(self, ids: list[int]) -> list[int]:
        """The engine's ids for the tokenizer's (`id % vocab`; without a tokenizer they are the same)."""
        return ids if self.tok is None else [i % self.vocab for i in ids]

    def shown(self, token: int) -> int:
        """The id a client sees for the engine's generated `token`: the tokenizer's id of the word it streams as
        (without a tokenizer, the engine's id)."""
        return token if self.tok is None else self.word_ids[token % len(WORDS)]

    def engine_stop_ids(self, ids: list[int]) -> set[int]:
        """The engine's ids that `stop_token_ids` (ids a client sees, `shown`) name: at most the vocabulary,
        however long the list; ids no generated token is shown as can never stop a request and are dropped."""
        if self.tok is None:
            return {i for i in ids if 0 <= i < self.vocab}
        words = {self._word_of[i] for i in ids if i in self._word_of}
        return {t for k in words for t in range(k, self.vocab, len(WORDS))}

    def decode(self, ids: list[int]) -> str:
        """The text of ids a client sees: the tokenizer's decoding (special tokens kept), the inverse of
        `encode`; without a tokenizer, the words generated tokens stream as. BadInput for an id outside them."""
        bad = next((i for i in ids if not 0 <= i < self.n_ids), None)
        if bad is not None:
            raise BadInput(f"token id {bad} is outside the vocabulary [0, {self.n_ids})")
        if self.tok is None:
            return "".join(piece(i) for i in ids)
        return self.tok.decode(ids, skip_special_tokens=False)

    def at_least(self, text: str, what: str = "prompt") -> int:
        """The fewest tokens `text` can encode to (see the module note); BadInput if it is not valid Unicode."""
        return -(-utf8_len(text, what) // self.max_token_bytes)

    def encode(self, text: str) -> list[int]:
        """The tokenizer's ids for `text` (what a client's tokenizer gives; the engine takes `engine_ids`)."""
        if self.tok is None:
            return list(text.encode("utf-8"))
        # encode_batch releases the interpreter lock while it works (encode holds it)
        return self.tok.encode_batch([text], add_special_tokens=False)[0].ids

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """A chat request's prompt text: the tokenizer's chat template, the assistant turn opened unless
        `add_generation_prompt` is false, as vLLM renders it (no template: one line per message)."""
        if self.template is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant:" if add_generation_prompt else "")
        return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt)

    def chat(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """The prompt of a chat request, as the tokenizer's ids."""
        return self.encode(self.render(messages, add_generation_prompt))

    def token_strs(self, text: str) -> list[str]:
        """The tokenizer's own strings for `text`'s tokens (no tokenizer: one character per byte)."""
        if self.tok is None:
            return [chr(b) for b in text.encode("utf-8")]
        return self.tok.encode_batch([text], add_special_tokens=False)[0].tokens
