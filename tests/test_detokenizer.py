"""Incremental detokenizer: UTF-8 safety, exact concatenation, stop strings anywhere."""

from __future__ import annotations

import pytest
from _helpers import CORPUS, tiny_tokenizer

from pagedserve.tokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def feed(tok, text, stop=(), include=False, prompt="Say: "):
    detok = IncrementalDetokenizer(tok, tok.encode(prompt), stop, include)
    pieces, matched = [], None
    for t in tok.encode(text):
        before = detok.stream_text()
        matched = detok.add_token(t)
        shown = detok.stream_text()
        assert shown.startswith(before), "streamed text was retracted"
        pieces.append(shown[len(before):])
        if matched:
            break
    else:
        matched = detok.flush()
        pieces.append(detok.stream_text()[len("".join(pieces)):])
    return detok, pieces, matched


@pytest.mark.parametrize("text", CORPUS + ["🙂🚀🙂", "é", "x🙂"])
def test_concatenation_equals_full_decode_and_no_half_characters(tok, text):
    detok, pieces, matched = feed(tok, text)
    assert matched is None
    assert "".join(pieces) == tok.decode(tok.encode(text)) == text
    assert not any("\ufffd" in p for p in pieces)


def test_multibyte_character_is_held_until_complete(tok):
    ids = tok.encode("🙂")
    assert len(ids) > 1  # the emoji spans several byte tokens
    detok = IncrementalDetokenizer(tok, [], ())
    for t in ids[:-1]:
        detok.add_token(t)
        assert detok.text == ""
    detok.add_token(ids[-1])
    assert detok.text == "🙂"


def test_incomplete_character_is_flushed_at_the_end(tok):
    ids = tok.encode("a🙂")
    detok = IncrementalDetokenizer(tok, [], ())
    for t in ids[:-1]:
        detok.add_token(t)
    assert detok.text == "a"
    detok.flush()
    assert detok.text.startswith("a") and detok.text.endswith("\ufffd")


def test_stop_string_inside_one_token(tok):
    text = "Once upon a time there was"
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    long_piece = next(p for p in pieces if len(p.strip()) >= 3)
    stop = long_piece.strip()[1:3]  # starts in the middle of a token
    detok, _, matched = feed(tok, text, stop=(stop,))
    assert matched == stop
    assert detok.text == text[: text.index(stop)]


def test_stop_string_at_first_characters(tok):
    detok, pieces, matched = feed(tok, "Once upon a time", stop=("On",))
    assert matched == "On" and detok.text == "" and "".join(pieces) == ""


def test_stop_string_across_tokens_and_earliest_wins(tok):
    text = "The quick brown fox jumps over the lazy dog."
    detok, _, matched = feed(tok, text, stop=("lazy", "k bro"))
    assert matched == "k bro" and detok.text == "The quic"


def test_include_stop_str_in_output(tok):
    detok, _, matched = feed(tok, "The quick brown fox", stop=("brown",), include=True)
    assert detok.text == "The quick brown"


def test_stream_text_holds_back_a_possible_stop_prefix(tok):
    detok = IncrementalDetokenizer(tok, [], ("fox!",))
    for t in tok.encode("The quick brown fo"):
        detok.add_token(t)
    assert detok.text == "The quick brown fo"
    assert detok.stream_text() == "The quick brown "  # "fo" may become "fox!"
    for t in tok.encode("x jumps"):
        detok.add_token(t)
    assert detok.stream_text() == detok.text  # it did not


def test_special_tokens_skipped(tok):
    detok = IncrementalDetokenizer(tok, [], ())
    for t in tok.encode("hi") + [tok.eos_token_id]:
        detok.add_token(t)
    detok.flush()
    assert detok.text == "hi"
