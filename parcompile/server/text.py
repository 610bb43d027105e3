"""A generated sequence's text as its tokens arrive (`parcompile serve`'s streamed and plain
answers, :meth:`parcompile.server.generation.Generation.generate`): detokenized incrementally as
vLLM's ``detokenize_incrementally`` does (``vllm/transformers_utils/detokenizer_utils.py``),
and cut at the first stop string, searched in the new text only, as vLLM's
``check_stop_strings`` does. Kept lean per token (issue 33: the front's CPU per streamed
token)."""

from __future__ import annotations

#: what a decoder writes for bytes that are no (or not yet a whole) UTF-8 character
REPLACEMENT = "\ufffd"


class IncrementalText:
    """One sequence's output text: :meth:`step` detokenizes the token ids that arrived,
    :meth:`find_stop` finds a stop string in the new text, :meth:`release` gives what may go
    out to the client.

    Detokenizing (vLLM's incremental detokenizer): each step decodes only a window of the
    last ids, from ``prefix`` (the start of the previous step's new tokens) on, and its new
    text is what that window's text adds to the text of its first part (``prefix`` to
    ``read``: the tokens already turned into text; decoding it in context keeps, say,
    SentencePiece's leading spaces). A window whose text ends in U+FFFD (an unfinished UTF-8
    character) or adds nothing is held back until a later token completes it (or the
    sequence ends: then it goes as it is). Text once made is final and never dropped: where
    a tokenizer's decode of more tokens rewrites the window's earlier characters (text that
    went out: ``clean_up_tokenization_spaces`` joining "do n" and "'t" into "don't"), the new
    text is the new tokens' own ("'t"), where vLLM's would be cut at the old text's length
    ("t").

    ``decode``: a tokenizer's ``decode(ids) -> str``; ``stop``: the stop strings (non-empty).
    Attributes: ``text`` (the final text so far: str), ``sent`` (how many of its characters
    :meth:`release` gave out), ``hold`` (the characters held back while a stop string may be
    completing: the longest stop string's length - 1).
    """

    __slots__ = ("decode", "prefix", "read", "prefix_text", "text", "sent", "stop", "hold")

    def __init__(self, decode, stop=()):
        self.decode = decode
        self.prefix = self.read = 0      # the window: ids[prefix:read] are text already, ids[read:] are new
        self.prefix_text = ""            # decode(ids[prefix:read])
        self.text = ""
        self.sent = 0
        self.stop = list(stop)
        self.hold = max(map(len, self.stop)) - 1 if self.stop else 0

    def step(self, ids: list[int], final: bool = False) -> str:
        """The text the ids from ``read`` to the end of ``ids`` (all of the sequence's token
        ids so far) add, appended to :attr:`text`: "" while held back; ``final`` (the
        sequence ended) gives the held text as it is."""
        n = len(ids)
        if n == self.read:
            return ""
        window = self.decode(ids[self.prefix:])
        if not final and (not window or window[-1] == REPLACEMENT):
            return ""                                     # an unfinished character: wait for its bytes
        if window.startswith(self.prefix_text):
            if not final and len(window) == len(self.prefix_text):
                return ""                                 # no text yet (a token of part of a character)
            delta = window[len(self.prefix_text):]
            if self.prefix == self.read:                  # the window was the new tokens alone
                self.prefix_text = window
            else:
                self.prefix_text = self.decode(ids[self.read:])
        else:
            # the new tokens rewrote the text of the window's first tokens, which went out:
            # the new tokens' own text (nothing dropped, nothing sent twice)
            delta = self.decode(ids[self.read:])
            if not final and (not delta or delta[-1] == REPLACEMENT):
                return ""
            self.prefix_text = delta
        self.prefix, self.read = self.read, n
        self.text += delta
        return delta

    def find_stop(self, new_chars: int) -> int:
        """Where in :attr:`text` the first stop string starts, searching only what its last
        ``new_chars`` characters can complete (from ``len(text) - new_chars - hold`` on:
        a match that starts earlier ended before them and was found at an earlier step);
        -1 when none does."""
        start = max(len(self.text) - new_chars - self.hold, 0)
        hit = -1
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (hit < 0 or i < hit):
                hit = i
        return hit

    def cut(self, at: int) -> None:
        """End the text at character ``at`` (a stop string's start)."""
        self.text = self.text[:at]

    def release(self, finished: bool) -> str:
        """The text that may go out now, from what was released before: all of it when the
        sequence ``finished`` or has no stop strings, else all but the last :attr:`hold`
        characters (they may begin a stop string)."""
        keep = len(self.text) if finished else len(self.text) - self.hold
        if keep <= self.sent:
            return ""
        out = self.text[self.sent:keep]
        self.sent = keep
        return out


__all__ = ["IncrementalText", "REPLACEMENT"]
