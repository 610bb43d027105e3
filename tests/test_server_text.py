"""The streamed text of `parcompile serve` (parcompile/server/text.py): incremental
detokenizing and stop strings, against the whole text decoded and searched at every token."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from parcompile.runtime.serve.generate import ByteTokenizer
from parcompile.server.text import IncrementalText


def _run(decode, tokens, stop):
    """Feed ``tokens`` one at a time as Generation.generate does; returns (the text released,
    the tokens taken when a stop string ended it, or all)."""
    t, ids, out = IncrementalText(decode, stop), [], []
    for i, tok in enumerate(tokens):
        ids.append(tok)
        last = i == len(tokens) - 1
        new = t.step(ids, final=last)
        stopped = False
        if stop and new:
            hit = t.find_stop(len(new))
            if hit >= 0:
                t.cut(hit)
                stopped = True
        out.append(t.release(last or stopped))
        if stopped:
            break
    return "".join(out), len(ids)


def _truth(decode, tokens, stop):
    """The whole text decoded after every token; the first token whose text holds a stop string ends it there."""
    for k in range(1, len(tokens) + 1):
        text = decode(tokens[:k])
        hits = [i for i in (text.find(s) for s in stop) if i >= 0]
        if hits:
            return text[:min(hits)], k
    return decode(tokens), len(tokens)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(b"abc"), min_size=1, max_size=40),
       st.lists(st.text(alphabet="abc", min_size=1, max_size=4), max_size=4))
def test_incremental_text_and_stop_strings_equal_decoding_and_searching_the_whole_text(tokens, stop):
    decode = ByteTokenizer().decode
    assert _run(decode, tokens, stop) == _truth(decode, tokens, stop)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(list("aé€😀".encode())), min_size=1, max_size=30))
def test_multibyte_characters_are_held_until_whole_and_the_text_equals_the_whole_decode(tokens):
    decode = ByteTokenizer().decode
    t, ids, sent = IncrementalText(decode), [], []
    for i, tok in enumerate(tokens):
        ids.append(tok)
        new = t.step(ids, final=i == len(tokens) - 1)
        assert not new.endswith("\ufffd") or i == len(tokens) - 1     # unfinished characters wait (but at the end)
        sent.append(t.release(i == len(tokens) - 1))
    assert "".join(sent) == decode(tokens)


def test_each_token_decodes_a_window_of_the_last_tokens_not_the_whole_text():
    """Per token the decoder sees the window (at most the last step's and this one's tokens),
    not every id so far: a long answer costs the same per token as a short one."""
    seen = []

    def decode(ids):
        seen.append(len(ids))
        return ByteTokenizer().decode(ids)

    tokens = list(b"the quick brown fox jumps over the lazy dog " * 10)
    assert _run(decode, tokens, ["zzz"]) == (bytes(tokens).decode(), len(tokens))
    assert max(seen) <= 2 and len(seen) <= 2 * len(tokens)
