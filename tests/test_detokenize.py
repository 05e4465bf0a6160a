"""Incremental detokenization: deltas concatenate to the full decode, across multi-byte characters."""

from rqbatcher.workers.engine.detokenize import IncrementalDetokenizer
from tests.tiny_models import build_tokenizer

TEXT = "Ünïcödé: café, naïve, 東京 and emoji 🙂 must survive."


def test_deltas_equal_the_full_decode_across_multibyte_characters():
    tok = build_tokenizer()
    ids = tok(TEXT)["input_ids"]
    split = next(k for k in range(3, len(ids)) if TEXT.startswith(tok.decode(ids[:k])))  # a character boundary
    prompt, generated = ids[:split], ids[split:]
    detok = IncrementalDetokenizer(tok, prompt)
    deltas = [detok.push(t) for t in generated] + [detok.flush()]
    assert "".join(deltas) == TEXT[len(tok.decode(prompt)):]
    assert all("\ufffd" not in d for d in deltas), "a partial character was released"
    assert sum(1 for d in deltas if d) > 5  # released incrementally, not all at the end


def test_stop_string_cuts_text_and_is_never_streamed():
    tok = build_tokenizer()
    ids = tok(TEXT)["input_ids"]
    detok = IncrementalDetokenizer(tok, ids[:1], stop=["naïve"])
    streamed = ""
    for t in ids[1:]:
        streamed += detok.push(t)
        if detok.stopped:
            break
    assert detok.stopped and detok.matched == "naïve"
    assert detok.text == tok.decode(ids[1:])[: tok.decode(ids[1:]).index("naïve")]
    assert streamed == detok.text


def test_of_two_stop_strings_completed_by_one_token_the_earlier_one_ends_the_text():
    tok = build_tokenizer()
    ids = tok(TEXT)["input_ids"]
    detok = IncrementalDetokenizer(tok, ids[:1], stop=["ïve", "naïve"])  # both end at the same character
    for t in ids[1:]:
        detok.push(t)
    whole = tok.decode(ids[1:])
    assert (detok.text, detok.matched) == (whole[: whole.index("naïve")], "naïve")
