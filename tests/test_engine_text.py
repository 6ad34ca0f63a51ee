"""Text out of `LLM.generate` and `outrider generate`: stop strings (a str or a list, found where
they start inside a token), streamed text equal to the final text, linear detokenizing work, and
the API's argument checks. Tiny models here; SmolLM2 for the two commands of the issue."""

import json

import pytest

from outrider import LLM
from outrider.cli import main
from outrider.errors import ConfigError, ModelError


@pytest.fixture(scope="module")
def tiny(tiny_folders):
    return LLM(str(tiny_folders["llama"]))


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def streamed_and_json(capsys, *argv):
    """The CLI's streamed stdout and its --json result for the same arguments."""
    code, streamed, err = run_cli(capsys, "generate", *argv)
    assert code == 0, err
    code, out, err = run_cli(capsys, "generate", "--json", *argv)
    assert code == 0, err
    return streamed, json.loads(out)


def covering_tokens(llm, ids, kept):
    """The fewest leading `ids` whose text covers `kept`."""
    return next(n for n in range(len(ids) + 1) if len(llm.decode(ids[:n])) >= len(kept))


# -- stop strings --------------------------------------------------------------------------------
def test_stop_starting_inside_a_token_is_cut_from_text_and_json(tiny, tiny_folders, capsys):
    prompt = "w5 w6 w7"
    full = tiny.generate(prompt, 40)
    stop = full.text[full.text.index("w58") + 2:][:4]  # "8 w5": starts inside the token "w58"
    assert stop == "8 w5"
    kept = full.text[:full.text.index(stop)]
    out = tiny.generate(prompt, 40, stop=[stop])
    assert out.text == kept and out.finish_reason == "stop"
    # the token holding the stop string's start ("w58") stays; the text ends before "8"
    n = covering_tokens(tiny, full.token_ids, kept)
    assert out.token_ids == full.token_ids[:n]
    assert tiny.decode(out.token_ids).startswith(kept) and len(tiny.decode(out.token_ids)) > len(kept)
    streamed, result = streamed_and_json(capsys, "--model", str(tiny_folders["llama"]), "--max-new-tokens", "40",
                                         "--stop", stop, prompt)
    assert result["text"] == kept and result["finish_reason"] == "stop"
    assert streamed == kept + "\n"


def test_stop_as_a_string_is_one_stop_string(tiny):
    prompt = "w5 w6 w7"
    full = tiny.generate(prompt, 40).text
    stop = "w91"  # its characters "w", "9", "1" all occur earlier than the string itself
    assert full.index("w") < full.index(stop)
    one = tiny.generate(prompt, 40, stop=stop)
    assert one.text == full[:full.index(stop)] and one.finish_reason == "stop"
    assert tiny.generate(prompt, 40, stop=[stop]).text == one.text
    assert tiny.generate(prompt, 40, stop=("nothing like it", stop)).text == one.text


def test_earliest_of_several_stops_wins_and_empty_stops_are_ignored(tiny):
    prompt = "w5 w6 w7"
    full = tiny.generate(prompt, 40).text
    out = tiny.generate(prompt, 40, stop=["w44", "", "w91"])
    assert out.text == full[:full.index("w91")]
    assert tiny.generate(prompt, 40, stop="").text == full


# -- streaming -----------------------------------------------------------------------------------
def test_on_text_gets_new_stable_text_that_adds_up_to_the_completion(tiny):
    prompts = ["w5 w6 w7", "w9 w10", "w3"]
    pieces = {i: [] for i in range(len(prompts))}
    outs = tiny.generate(prompts, 30, stop=["w72 w4", "w29 w29 w29 w29"],
                         on_text=lambda i, new: pieces[i].append(new))
    for i, out in enumerate(outs):
        assert "".join(pieces[i]) == out.text
        assert all(pieces[i])  # no empty calls
    assert len(pieces[0]) > 1  # streamed as it went, not all at the end


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_cli_stream_equals_json_text(capsys, tiny_folders, drafter):
    extra = ["--drafter", drafter] if drafter else []
    for prompt, stops in [("w3", []), ("w9 w10", ["w29 w29 w29"]), ("w5 w6 w7", ["1 w29", "w44"])]:
        argv = ["--model", str(tiny_folders["llama"]), "--max-new-tokens", "30", *extra, prompt]
        for s in stops:
            argv[:0] = ["--stop", s]
        streamed, result = streamed_and_json(capsys, *argv)
        assert streamed == result["text"] + "\n"


def test_detokenizing_work_is_linear_in_output_length(tiny_folders):
    """The old loop decoded the whole output after every round: ~n^2/2 ids for n tokens."""
    llm = LLM(str(tiny_folders["llama"]))  # its own tokenizer, to count its decodes
    decoded = [0]
    decode = llm.tokenizer.decode

    def counting(ids, *args, **kwargs):
        decoded[0] += len(ids)
        return decode(ids, *args, **kwargs)

    llm.tokenizer.decode = counting
    out = llm.generate("w5 w6 w7", 120, stop=["w3 w3 w3 w3 w3 w3 w3"], on_text=lambda i, t: None)
    n = len(out.token_ids)
    assert n == 120, n
    assert decoded[0] < 8 * n, (decoded[0], n)


# -- argument checks -----------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, error, words", [
    (dict(prompts=[]), ValueError, "at least one prompt"),
    (dict(prompts=5), TypeError, "str or a list of str"),
    (dict(prompts=b"w5"), TypeError, "str or a list of str"),
    (dict(prompts=["w5", 3]), TypeError, "prompts[1]"),
    (dict(max_new_tokens=0), ValueError, "max_new_tokens must be >= 1"),
    (dict(max_new_tokens="8"), TypeError, "max_new_tokens must be an int"),
    (dict(max_new_tokens=2.5), TypeError, "max_new_tokens must be an int"),
    (dict(max_new_tokens=True), TypeError, "max_new_tokens must be an int"),
    (dict(stop=5), TypeError, "stop must be a str or a list of str"),
    (dict(stop=["w5", None]), TypeError, "stop[1]"),
    (dict(chat="yes"), TypeError, "chat must be True or False"),
    (dict(on_text="print"), TypeError, "on_text must be a function"),
    (dict(prompts="abc \udcff"), ConfigError, "not valid UTF-8 text (byte 0xff at character 4)"),
    (dict(prompts=["ok", "\ud800"]), ConfigError, "prompt 1 is not valid UTF-8 text (lone surrogate U+D800"),
    (dict(stop="\udcfe"), ConfigError, "stop string 0 is not valid UTF-8"),
])
def test_generate_refuses_bad_arguments_saying_what_to_pass(tiny, kwargs, error, words):
    args = dict(prompts="w5", max_new_tokens=4) | kwargs
    with pytest.raises(error) as info:
        tiny.generate(args.pop("prompts"), **args)
    message = str(info.value)
    assert words in message and "\n" not in message, message


def test_cli_prompt_with_bytes_not_utf8_is_one_line_error(capsys, tiny_folders):
    # `outrider generate $'\xff\xfe abc'`: Python hands the bytes in as lone surrogates
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_folders["llama"]), "\udcff\udcfe abc")
    assert code == 2 and out == ""
    assert err.strip().splitlines() == ["error: the prompt is not valid UTF-8 text (byte 0xff at character 0): "
                                        "pass UTF-8 text"]
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_folders["llama"]), "--stop", "\udcff", "w5")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "stop string" in err


# -- SmolLM2: the two commands of the issue ------------------------------------------------------
@pytest.fixture(scope="module")
def smol():
    try:
        return LLM("smollm2-135m-instruct")
    except ModelError as err:
        pytest.fail(f"{err} (or deselect with -m 'not model')")


@pytest.mark.model
def test_smollm2_split_characters_stream_whole(capsys):
    prompt = "Café, naïve, 日本の首都は東京です。中国的首都是"
    streamed, result = streamed_and_json(capsys, "--max-new-tokens", "16", prompt)
    assert streamed == result["text"] + "\n"
    # characters split over tokens ("日本の首都" here) stream whole; only a character that the
    # 16th token leaves incomplete shows as U+FFFD, at the very end, as in the --json text
    assert any(ord(c) > 0x3000 for c in result["text"])
    assert "\ufffd" not in result["text"].rstrip("\ufffd")


@pytest.mark.model
def test_smollm2_stop_inside_a_token(capsys, smol):
    prompt, stop = "def fibonacci(n):", "fibonacci(n - 1)"
    full = smol.generate(prompt, 24)  # greedy: the first 24 of the 48 tokens; the stop string is in them
    assert stop in full.text
    kept = full.text[:full.text.index(stop)]
    streamed, result = streamed_and_json(capsys, "--max-new-tokens", "48", "--stop", stop, prompt)
    assert result["text"] == kept and result["finish_reason"] == "stop"
    assert streamed == kept + "\n"
    n = covering_tokens(smol, full.token_ids, kept)
    assert result["token_ids"] == full.token_ids[:n]
    # this case's stop string starts inside the kept last token (" fib...")
    assert len(smol.decode(result["token_ids"])) > len(kept)
