"""TextStream (outrider/engine/text_stream.py), the incremental detokenizer, against reference_text, the slow
definition: on hand-made byte-level vocabularies, on word-level and Metaspace tokenizers with
special tokens, and on random token sequences of the real SmolLM2 tokenizer."""

import random

import pytest

from outrider.errors import ConfigError
from outrider.engine.text_stream import REPLACEMENT, TextStream, check_text, reference_text

# A byte-level vocabulary: characters split across tokens, a lone invalid byte, an empty token
# (as a skipped special token decodes).
BYTES = [b"", b"Hi", "日".encode()[:2], "日".encode()[2:], b" fib", b"onacci(n", b" - 1)", b"\xff", b"a",
         "é".encode()[:1], "é".encode()[1:], "😀".encode()[:3], "😀".encode()[3:], b"\n", "本".encode(), b" n *"]


def byte_decode(ids):
    return b"".join(BYTES[i] for i in ids).decode("utf-8", "replace")


def run_stream(decode, ids, stops, chunks):
    """Feed `ids` in pieces of the given sizes; check every step against the reference.
    Returns (shown text, stream)."""
    stream, shown, at = TextStream(decode, stops), "", 0
    for size in chunks:
        if at >= len(ids) or stream.stopped:
            break
        shown += stream.add(ids[at:at + size])
        at += size
        expected = reference_text(decode, ids[:at], stops)
        assert shown == expected.visible, (ids[:at], stops, shown, expected)
        assert stream.stopped == expected.stopped
    if at < len(ids) and not stream.stopped:
        shown += stream.add(ids[at:])
    shown += stream.finish()
    expected = reference_text(decode, ids, stops)
    assert (shown, stream.text, stream.kept_tokens, stream.stopped) == \
        (expected.text, expected.text, expected.kept_tokens, expected.stopped), (ids, stops, expected)
    return shown, stream


def random_stops(rng, text, fixed):
    stops = []
    for _ in range(rng.randrange(0, 4)):
        if text and rng.random() < 0.7:  # a piece of the text: it will be found, often mid-token
            a = rng.randrange(len(text))
            stops.append(text[a:a + rng.randrange(1, 8)])
        else:
            stops.append(rng.choice(fixed))
    return stops


def random_chunks(rng, n):
    return [rng.randrange(1, 6) for _ in range(n)]


def test_split_character_is_held_back_until_whole():
    stream = TextStream(byte_decode)
    assert stream.add([1]) == "Hi"
    assert stream.add([2]) == ""  # "日"'s first two bytes: nothing stable yet
    assert stream.add([3, 9]) == "日"  # "é"'s first byte held back
    assert stream.add([10]) == "é"
    assert stream.finish() == "" and stream.text == "Hi日é"


def test_stop_string_starting_inside_a_token():
    # tokens: "Hi" " n *" " fib" "onacci(n" " - 1)" ; the stop string starts at the "f" of " fib"
    ids = [1, 15, 4, 5, 6, 8]
    stream = TextStream(byte_decode, ["fibonacci(n - 1)"])
    shown = [stream.add([i]) for i in ids[:3]]
    assert "".join(shown) == "Hi n * "  # "fib" could begin the stop string: held back
    shown.append(stream.add(ids[3:]))
    assert stream.stopped and "".join(shown) == "Hi n * " and stream.finish() == ""
    assert stream.text == "Hi n * "
    assert stream.kept_tokens == 3  # " fib" holds the stop string's start and stays


def test_held_back_prefix_is_released_when_it_does_not_complete():
    stream = TextStream(byte_decode, ["fibonacci(n - 1)"])
    assert stream.add([1, 4]) == "Hi "
    assert stream.add([8]) == "fiba"  # "fiba" cannot begin the stop string any more
    assert not stream.stopped


def test_unfinished_tail_comes_out_at_finish():
    stream = TextStream(byte_decode, ["fibonacci"])
    assert stream.add([1, 4, 2]) == "Hi "  # " fib" may begin the stop string, "日" is incomplete
    assert stream.finish() == "fib" + REPLACEMENT
    assert stream.text == byte_decode([1, 4, 2]) and stream.kept_tokens == 3


def test_stop_string_at_the_very_start_keeps_no_tokens():
    stream = TextStream(byte_decode, ["Hi"])
    assert stream.add([1, 8]) == "" and stream.stopped and stream.kept_tokens == 0 and stream.text == ""


def test_ids_after_a_stop_are_ignored_but_counted():
    stream = TextStream(byte_decode, ["a"])
    stream.add([1, 8, 1, 1])  # "Hi" "a" "Hi" "Hi": the stop string starts where token 1 does
    assert stream.kept_tokens == 1 and stream.fed == 4 and stream.text == "Hi"
    assert stream.add([8]) == "" and stream.text == "Hi"


def test_random_byte_level_sequences_match_the_reference():
    rng = random.Random(0)
    for _ in range(1500):
        ids = [rng.randrange(len(BYTES)) for _ in range(rng.randrange(0, 30))]
        stops = random_stops(rng, byte_decode(ids), ["fib", "日本", "a\n", "é", "Hi"])
        run_stream(byte_decode, ids, stops, random_chunks(rng, len(ids)))


def test_grouping_into_rounds_changes_nothing():
    """One token per round (autoregressive) or many (speculative): same text, same cut."""
    rng = random.Random(1)
    for _ in range(300):
        ids = [rng.randrange(len(BYTES)) for _ in range(30)]
        stops = random_stops(rng, byte_decode(ids), ["fib", "日本"])
        one = run_stream(byte_decode, ids, stops, [1] * len(ids))
        many = run_stream(byte_decode, ids, stops, random_chunks(rng, len(ids)))
        assert (one[0], one[1].kept_tokens) == (many[0], many[1].kept_tokens)


def test_work_is_linear_in_output_length():
    decoded = [0]

    def counting(ids):
        decoded[0] += len(ids)
        return byte_decode(ids)

    rng = random.Random(2)
    ids = [rng.choice([1, 2, 3, 4, 5, 8, 9, 10, 11, 12, 13, 14]) for _ in range(4000)]
    stream = TextStream(counting, ["never in it", "日日日"])
    for at in range(0, len(ids), 3):
        stream.add(ids[at:at + 3])
    stream.finish()
    assert decoded[0] < 6 * len(ids), decoded[0]


def word_level(decoder_kind):
    """An in-memory tokenizer with special tokens: WordPiece joiner or Metaspace ("▁", whose
    decode drops the first token's leading space)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    if decoder_kind == "wordpiece":
        words = ["<unk>", "<s>", "</s>", "w1", "w2", "w3", "##x", "##y", "9"]
        decoder = decoders.WordPiece(prefix="##")
    else:
        words = ["<unk>", "<s>", "</s>", "▁Hello", "▁world", "lo", "▁", "!", "▁fi", "b"]
        decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.decoder = decoder
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    return len(words), lambda ids: fast.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


@pytest.mark.parametrize("kind", ["wordpiece", "metaspace"])
def test_word_level_decoders_with_special_tokens_match_the_reference(kind):
    size, decode = word_level(kind)
    rng = random.Random(3)
    for _ in range(300):
        ids = [rng.randrange(size) for _ in range(rng.randrange(0, 16))]
        full = decode(ids)
        stops = random_stops(rng, full, ["w2 w3", "lo!", "d"])
        shown, stream = run_stream(decode, ids, stops, random_chunks(rng, len(ids)))
        if not stream.stopped:
            assert shown == full


def test_check_text_names_the_bad_byte():
    check_text("Café, 日本 😀", "the prompt")
    with pytest.raises(ConfigError, match=r"the prompt is not valid UTF-8 text \(byte 0xfe at character 1\)"):
        check_text("a\udcfe", "the prompt")


# -- the real SmolLM2 tokenizer ------------------------------------------------------------------
TEXTS = [
    "Café, naïve, façade, Zürich, São Paulo, crème brûlée.",
    "日本の首都は東京です。中国的首都是北京。한국의 수도는 서울입니다.",
    "Emoji: 😀🎉👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵 — done…",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Ελληνικά, русский, עברית, العربية, हिन्दी",
]


@pytest.mark.model
def test_smollm2_random_token_sequences_match_the_reference():
    from transformers import AutoTokenizer

    from outrider.catalog.resolve import resolve_model

    tok = AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m-instruct")))

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    pieces = sorted({i for t in TEXTS for i in tok(t)["input_ids"]})  # many are bytes of a character
    specials = list(tok.all_special_ids)
    rng = random.Random(4)
    for trial in range(120):
        if trial % 3 == 0:  # real text cut and spliced: characters split at the seams
            text = rng.choice(TEXTS)
            ids = tok(text)["input_ids"]
            a = rng.randrange(len(ids))
            ids = ids[a:a + rng.randrange(5, 40)] + tok(rng.choice(TEXTS))["input_ids"][:rng.randrange(1, 20)]
        else:  # random pieces, byte-level fragments, special tokens and any vocabulary token
            ids = [rng.choice(pieces) if rng.random() < 0.8 else
                   rng.choice(specials) if rng.random() < 0.3 else rng.randrange(len(tok))
                   for _ in range(rng.randrange(1, 50))]
        stops = random_stops(rng, decode(ids), ["の", "é", "😀", "fibonacci(n - 1)", "\n    "])
        run_stream(decode, ids, stops, random_chunks(rng, len(ids)))


# -- contracts a mutant broke without a test noticing (mutation testing, issue 29) -----------------

def test_add_after_finish_is_refused_and_kept_tokens_is_none_until_known():
    stream = TextStream(byte_decode, ["fib"])
    assert stream.add([1, 8]) == "Hia" and stream.kept_tokens is None and not stream.stopped
    assert stream.finish() == "" and stream.kept_tokens == 2 and stream.finish() == ""
    with pytest.raises(RuntimeError) as err:
        stream.add([1])
    assert str(err.value) == "TextStream.add after finish()"


@pytest.mark.parametrize("stops", [["X"], ["XHi"], ["XX", "X"], ["\nHi"]])
def test_a_stop_string_never_matches_before_the_output(stops):
    """Nothing precedes the output's first character, not even for a one-character stop string."""
    for chunks in ([1] * 6, [6]):
        stream, shown, at = TextStream(byte_decode, stops), "", 0
        for size in chunks:
            shown += stream.add([1, 8, 1, 13, 8, 1][at: at + size])
            at += size
        assert not stream.stopped and shown + stream.finish() == "HiaHi\naHi" == stream.text


def test_reference_text_refuses_a_decoder_whose_text_shrinks():
    with pytest.raises(AssertionError) as err:
        reference_text(lambda ids: "abc"[: 3 - len(ids)], [5, 6])
    assert str(err.value) == "stable text must only grow"


@pytest.mark.parametrize("text, found", [
    ("a\udc80", "byte 0x80 at character 1"), ("ab\udcff", "byte 0xff at character 2"),
    ("\udc7f", "lone surrogate U+DC7F at character 0"), ("x\udd00", "lone surrogate U+DD00 at character 1"),
    ("\ud800y", "lone surrogate U+D800 at character 0"), ("日\udbff", "lone surrogate U+DBFF at character 1"),
])
def test_check_text_names_each_bad_character_word_for_word(text, found):
    with pytest.raises(ConfigError) as err:
        check_text(text, "the stop string")
    assert str(err.value) == f"the stop string is not valid UTF-8 text ({found}): pass UTF-8 text"
