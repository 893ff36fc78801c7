"""Streamed text: the incremental detokenizer never emits a broken UTF-8 character, and stop
strings cut the text where they first appear without any part of them reaching the stream."""

from __future__ import annotations

import pytest

import jaxllm
from jaxllm.text.detokenize import Detokenizer, StopMatcher


@pytest.fixture(scope="module")
def default_tok():
    return jaxllm.load_tokenizer()


class ByteTokenizer:
    """A tiny tokenizer whose ids are UTF-8 bytes: every character past ASCII spans ids."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


TEXTS = ["plain ascii text", "héllo wörld", "数学 and 日本語のテキスト", "emoji 🎉🙂 and 👩‍👩‍👧 family",
         "mixed: naïve café 😀 数 ok"]


def _pieces(tok, ids) -> list[str]:
    d = Detokenizer(tok)
    return [d.push(t) for t in ids] + [d.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_bytes_never_split_a_character(text):
    tok = ByteTokenizer()
    pieces = _pieces(tok, tok.encode(text))
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)
    if any(ord(ch) > 127 for ch in text):
        assert "" in pieces[:-1]  # a multi-byte character was held back until complete


@pytest.mark.parametrize("text", TEXTS)
def test_default_tokenizer_stream_equals_decode(default_tok, text):
    ids = default_tok.encode(text, add_special_tokens=False)
    pieces = _pieces(default_tok, ids)
    assert "".join(pieces) == default_tok.decode(ids, True) == text
    assert all("\ufffd" not in p for p in pieces)


def test_default_tokenizer_holds_back_split_emoji(default_tok):
    # SmolLM2's byte-level BPE spells a rare emoji with several byte tokens
    ids = default_tok.encode("🦜", add_special_tokens=False)
    assert len(ids) > 1
    assert _pieces(default_tok, ids) == [""] * (len(ids) - 1) + ["🦜", ""]


def test_unfinished_character_at_the_end_is_flushed_as_replacement():
    tok = ByteTokenizer()
    d = Detokenizer(tok)
    assert [d.push(t) for t in "é".encode()[:1]] == [""]
    assert d.flush() == "\ufffd"


def _stream(stops, chunks) -> tuple[list[str], bool]:
    m = StopMatcher(stops)
    out = [m.push(c) for c in chunks]
    if not m.stopped:
        out.append(m.flush())
    return out, m.stopped


@pytest.mark.parametrize("chunks", [list("Hello ABCDEFGHIJ world"), ["Hello AB", "CD", "EF", "GHI", "J wor"],
                                    ["Hello ABCDEFGHIJ world"]])
def test_multi_character_stop_never_leaks(chunks):
    out, stopped = _stream(["DEFGHIJ"], chunks)
    assert stopped
    assert "".join(out) == "Hello ABC"


def test_stop_at_the_first_character():
    out, stopped = _stream(["H"], ["Hello"])
    assert stopped and "".join(out) == ""
    out, stopped = _stream(["Hel"], list("Hello"))
    assert stopped and out == ["", "", "", "", ""]


@pytest.mark.parametrize("chunks", [list("xabcdy"), ["xabcdy"], ["xa", "bcdy"]])
def test_overlapping_stops_cut_where_one_first_completes(chunks):
    # "bc" completes (at 'c') before "abcd" does (at 'd'), whatever the pieces
    out, stopped = _stream(["abcd", "bc"], chunks)
    assert stopped and "".join(out) == "xa"


@pytest.mark.parametrize("chunks", [list("aaab"), ["aa", "ab"], ["aaab"]])
def test_self_overlapping_stop(chunks):
    out, stopped = _stream(["aab"], chunks)
    assert stopped and "".join(out) == "a"


def test_held_text_is_released_once_it_cannot_match():
    m = StopMatcher(["xyz", "END"])
    assert m.push("ab x") == "ab "
    assert m.push("y") == ""
    assert m.push("a E") == "xya "
    assert m.push("N") == ""
    assert m.flush() == "EN"
    assert not m.stopped


def test_four_stops_and_nothing_after_a_stop():
    m = StopMatcher(["one", "two", "three", "four"])
    assert m.push("zero thr") == "zero "
    assert m.push("ee, four") == ""
    assert m.stopped
    assert m.push("more") == "" and m.flush() == ""


def test_stop_strings_over_default_tokenizer_tokens(default_tok):
    text = "The quick brown fox jumps over the lazy dog"
    ids = default_tok.encode(text, add_special_tokens=False)
    d, m = Detokenizer(default_tok), StopMatcher(["fox jumps over"])
    shown = []
    for t in ids:
        shown.append(m.push(d.push(t)))
        if m.stopped:
            break
    assert m.stopped and "".join(shown) == "The quick brown "
