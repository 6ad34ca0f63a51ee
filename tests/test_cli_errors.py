"""The CLI end to end on a tiny model, and bad input: one line, `error: ...`, non-zero exit."""

import json
import shutil

import pytest

from outrider.cli import main


def run_cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_generate_json_and_stats(capsys, tiny_folders):
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_folders["llama"]), "--max-new-tokens", "6",
                             "--json", "w5 w6 w7")
    assert code == 0
    result = json.loads(out)
    assert len(result["token_ids"]) == 6 and result["stats"]["new_tokens"] == 6
    assert result["stats"]["tokens_per_s"] > 0
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_folders["llama"]), "--max-new-tokens", "6",
                             "--drafter", "early-exit:1", "--stats", "--json", "w5 w6 w7")
    spec = json.loads(out)
    assert spec["token_ids"] == result["token_ids"]  # greedy: the drafter changes nothing
    for key in ("mean_accepted_length", "acceptance_by_position", "rounds", "draft_s", "verify_s"):
        assert key in spec["stats"]
    assert "tau" in err


def test_chat_and_streaming(capsys, tiny_folders):
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_folders["qwen2"]), "--chat",
                             "--max-new-tokens", "5", "w9 w10")
    assert code == 0 and out.strip()


def test_same_seed_same_text(capsys, tiny_folders):
    args = ("generate", "--model", str(tiny_folders["llama"]), "--max-new-tokens", "8", "--temperature", "1.0",
            "--seed", "3", "--json", "w5")
    first = json.loads(run_cli(capsys, *args)[1])["token_ids"]
    second = json.loads(run_cli(capsys, *args)[1])["token_ids"]
    assert first == second


def one_line_error(capsys, *argv, expect: str):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert expect in lines[0], lines[0]
    return lines[0]


def test_unknown_model_lists_known_ones(capsys):
    line = one_line_error(capsys, "generate", "--model", "no-such-model", "hi", expect="unknown model")
    assert "smollm2-135m-instruct" in line


def test_invalid_sampling_values(capsys, tiny_folders):
    m = str(tiny_folders["llama"])
    one_line_error(capsys, "generate", "--model", m, "--temperature", "-1", "x", expect="temperature")
    one_line_error(capsys, "generate", "--model", m, "--top-p", "0", "x", expect="top_p")
    one_line_error(capsys, "generate", "--model", m, "--top-k", "-2", "x", expect="top_k")
    one_line_error(capsys, "generate", "--model", m, "--max-new-tokens", "0", "x", expect="--max-new-tokens")


def test_bad_speculation_options(capsys, tiny_folders):
    m = str(tiny_folders["llama"])
    one_line_error(capsys, "generate", "--model", m, "--drafter", "magic", "x", expect="unknown drafter")
    one_line_error(capsys, "generate", "--model", m, "--drafter", "early-exit:9", "x", expect="layers")
    one_line_error(capsys, "generate", "--model", m, "--drafter", "ngram", "--tree", "static:2,2", "x",
                   expect="model drafters")
    one_line_error(capsys, "generate", "--model", m, "--drafter", "ngram", "--controller", "fast", "x",
                   expect="controller")
    one_line_error(capsys, "generate", "--model", m, "--tree", "static:x", "--drafter", "early-exit:1", "x",
                   expect="tree")


def test_draft_model_with_another_tokenizer_is_refused(capsys, tiny_folders, tmp_path):
    other = tmp_path / "other"
    shutil.copytree(tiny_folders["llama-draft"], other)
    from tiny import add_tokenizer

    add_tokenizer(other, vocab=80)
    one_line_error(capsys, "generate", "--model", str(tiny_folders["llama"]), "--drafter",
                   f"draft-model:{other}", "x", expect="tokenizer differs")


def test_prompt_longer_than_context(capsys, tiny_folders):
    long_prompt = " ".join(["w5"] * 300)  # the tiny models hold 256 positions
    one_line_error(capsys, "generate", "--model", str(tiny_folders["llama"]), long_prompt, expect="context")


def test_unsupported_architecture(capsys, tiny_folders, tmp_path):
    folder = tmp_path / "gpt2ish"
    shutil.copytree(tiny_folders["llama"], folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (folder / "config.json").write_text(json.dumps(config))
    line = one_line_error(capsys, "generate", "--model", str(folder), "x", expect="not supported")
    assert "LlamaForCausalLM" in line


def test_corrupt_weights(capsys, tiny_folders, tmp_path):
    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_folders["llama"], folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    one_line_error(capsys, "generate", "--model", str(folder), "x", expect="corrupt")


def test_folder_without_config(capsys, tmp_path):
    one_line_error(capsys, "generate", "--model", str(tmp_path), "x", expect="config.json")
