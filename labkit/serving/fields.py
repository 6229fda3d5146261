"""Every string of a request to `labkit serve`, counted once, before anything is tokenized or kept.

A body is bounded in bytes (`--max-body-mib`) before it is parsed; once parsed, one walk visits every string in
it, whatever field it sits in (the prompt, a chat message's `role`, `name` or text parts, `tools`, `model`, a stop
string, a field the server does not read) and at any depth:

- each must be valid Unicode: a lone surrogate such as `"\\ud800"`, which JSON can carry, is refused by name
  (`messages[0].role is not valid Unicode text: ...`), never handed to a tokenizer, a template or a reply;
- together they must fit the context: the request's text, at the tokenizer's most bytes per token
  (`TokenText.at_least`), may not be more tokens than `max_model_len`. No field escapes the bound that the
  prompt alone used to have (a 15 MB chat `role` was rendered into the template and tokenized for 42 s).

Field names are checked for valid Unicode too but not counted: they are the request's structure, not its text.
The walk is a loop over what the parser built (no recursion, no copies but each non-ASCII string's encoding),
so it costs less than the parse it follows.
"""
from __future__ import annotations

from ..params import BadInput
from .tokentext import TokenText, utf8_len


def _nbytes(s: str) -> int:
    return len(s) if s.isascii() else len(s.encode("utf-8"))      # UnicodeEncodeError for a lone surrogate


def text_bytes(body) -> int:
    """The UTF-8 bytes of every string value in a parsed JSON body; BadInput naming a string (or field name)
    that is not valid Unicode. A loop, not recursion: a body as deep as the parser took costs no stack."""
    total, stack = 0, [body]
    try:
        while stack:
            node = stack.pop()
            if type(node) is dict:
                for k in node:
                    _nbytes(k)
                values = node.values()
            else:
                values = node
            for v in values:
                t = type(v)
                if t is str:
                    total += _nbytes(v)
                elif t is dict or t is list:
                    stack.append(v)
    except UnicodeEncodeError:
        _name_bad_text(body)          # raises BadInput naming where
        raise BadInput("the request holds text that is not valid Unicode (a lone surrogate)") from None
    return total


def _name_bad_text(body) -> None:
    """An invalid string as BadInput, named by its path (`messages[0].role`, `stop[1]`, `model`); only
    after `text_bytes` found one, so the fast walk builds no paths."""
    stack = [(body, "")]
    while stack:
        node, path = stack.pop()
        named = type(node) is dict
        for k, v in node.items() if named else enumerate(node):
            if named:
                utf8_len(k, f"a field name in {_shown(path) or 'the body'}")
            where = (f"{path}.{k}" if path else k) if named else f"{path}[{k}]"
            if type(v) is str:
                utf8_len(v, _shown(where))
            elif type(v) in (dict, list):
                stack.append((v, where))


def _shown(path: str, most: int = 120) -> str:
    """A path short enough for one line (a field name may be megabytes long)."""
    return path if len(path) <= most else path[:most] + "..."


def check_text(body: dict, capacity: int, text: TokenText) -> None:
    """BadInput (one line, HTTP 400) for a body with text that is not valid Unicode, or more text than
    `capacity` tokens could hold."""
    n = text_bytes(body)
    at_least = -(-n // text.max_token_bytes)
    if at_least > capacity:
        raise BadInput(f"This model's maximum context length is {capacity:,} tokens: the request's text (every "
                       f"string in it, {n:,} bytes) is at least {at_least:,} tokens")
