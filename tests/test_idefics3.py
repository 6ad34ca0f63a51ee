"""Idefics3 / SmolVLM, a vision-language family (models/idefics3.py; issue 44 item 4): a tiny random
model saved by transformers, against transformers' own implementation with an image: the vision
tower's features, logits whole / chunked / decode, greedy tokens of `generate`; greedy speculation
(suffix, static draft-model and early-exit trees, a DFlash block drafter with GLANCE's tree on the fused hidden
states) equal to plain; `outrider generate --image`; the one-line refusals."""

import json

import pytest
import torch
import transformers as tf
from dflash_fixtures import random_head

from outrider.cli import main
from outrider.drafters.dflash import DFlashDrafter
from outrider.control.controllers import FixedController
from outrider.engine.generate import generate_ids
from outrider.engine.loop import EngineLoop
from outrider.engine.request import Request
from outrider.engine.speculator import SpecOptions, Speculator
from outrider.errors import ConfigError, ModelError
from outrider.models.batch import pack, with_embeds
from outrider.models.image_pixels import read_image, read_pixels
from outrider.models.image_prompt import expand, prompt_embeds
from outrider.sampling import SamplingParams
from outrider.spec.shapes import parse_shape
from outrider.weights.loader import load_decoder
from tiny import add_tokenizer, make_tiny

VOCAB, IMAGE, AROUND, GLOBAL = 96, 93, 94, 95
GRID, GRID_NAMES = 84, [f"<row_{i}_col_{j}>" for i in (1, 2, 3) for j in (1, 2, 3)]  # tokens 84 .. 92
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {% if m['content'] is string %}{{ m['content'] }}"
            "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}"
            "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def _tokenizer(folder):
    """A word-level tokenizer w3 .. w83, with <row_i_col_j> (i, j <= 3) as special tokens 84 .. 92
    and <image>, <fake_token_around_image> and <global-img> as 93, 94, 95 (as SmolVLM's tokenizer
    keeps them) and a chat template that places an image content item as <image>."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, **{f"w{i}": i for i in range(3, GRID)},
             **{name: GRID + i for i, name in enumerate(GRID_NAMES)},
             "<image>": IMAGE, "<fake_token_around_image>": AROUND, "<global-img>": GLOBAL}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.add_special_tokens([AddedToken(w, normalized=False, special=True)
                            for w in ("<|im_start|>", "<|im_end|>", "<image>", "<fake_token_around_image>",
                                      "<global-img>", *GRID_NAMES)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<|im_end|>",
                                   bos_token="<|im_start|>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(folder)
    return fast


def _save(folder, arch="Idefics3", seed=0):
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=112, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8)
    config = getattr(tf, f"{arch}Config")(text_config=text, vision_config=vision, scale_factor=2, image_token_id=IMAGE)
    torch.manual_seed(seed)
    model = getattr(tf, f"{arch}ForConditionalGeneration")(config).eval()
    with torch.no_grad():  # larger weights than the init, so that logits are far from uniform
        for name, p in model.named_parameters():
            if "text_model" in name or "lm_head" in name:
                p.mul_(4.0 if p.dim() > 1 else 1.0)
            elif p.dim() > 1:  # the vision side: larger too, so that its features move the logits
                p.mul_(8.0)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("idefics3")
    reference = _save(folder)
    tokenizer = _tokenizer(folder)
    model = load_decoder(folder, "cpu", torch.float32)
    torch.manual_seed(1)
    pixels = torch.randn(2, 3, 32, 32)  # two images, as the processor gives them (normalized)
    text = [5, 6, 7, IMAGE, 8, 9, 10, 11, 12, IMAGE, 13, 14, 15, 16, 6, 7]
    ids = expand(text, model.config.vision, tokenizer)
    return folder, reference, tokenizer, model, pixels, ids


def _reference_logits(reference, ids, pixels):
    with torch.no_grad():
        return reference(input_ids=torch.tensor([ids]), pixel_values=pixels[None]).logits[0]  # [T, vocab]


def _our_logits(model, ids, embeds, cuts):
    """ids' logits [T, vocab] from one slot's forwards over ids[cuts[i]:cuts[i + 1]], each with the
    image rows that fall in it (as the engine's prefill gives them: engine/loop.py)."""
    tokens = torch.tensor(ids)
    cache = model.new_cache(1, len(ids) + 8)
    rows = []
    for start, stop in zip(cuts, cuts[1:]):
        batch = with_embeds(pack([0], [start], [tokens[start:stop]], scratch_row=cache.scratch_row),
                            [(start, stop - start, embeds)])
        rows.append(model.forward(batch, cache).logits[0])
        cache.set_length(0, stop)
    return torch.cat(rows)


def test_vision_tower_gives_transformers_image_features(vlm):
    _, reference, _, model, pixels, _ = vlm
    with torch.no_grad():
        want = reference.model.get_image_features(pixels[None]).pooler_output  # one [N K, E] a prompt
    got = model.vision.features(pixels)
    assert got.shape == (2, 4, 64)
    assert torch.allclose(got, torch.cat(list(want)).view(2, 4, 64), atol=1e-5, rtol=1e-4)


def test_logits_with_images_whole_chunked_and_decode(vlm):
    _, reference, _, model, pixels, ids = vlm
    assert ids.count(IMAGE) == 8 and len(ids) == 28
    want = _reference_logits(reference, ids, pixels)
    embeds = prompt_embeds(model.vision, ids, list(pixels))
    for cuts in ([0, len(ids)], [0, 5, 11, 19, len(ids)], [0, 20, *range(21, len(ids) + 1)]):
        got = _our_logits(model, ids, embeds, cuts)
        assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), cuts
    without = _our_logits(model, ids, None, [0, len(ids)])  # the image moves them: the test can fail
    assert (without - want).abs().max() > 0.1


def _requests(ids, embeds, n=24):
    return [Request(ids, n, SamplingParams(0.0), prompt_embeds=embeds, ignore_eos=True)]


def test_greedy_tokens_equal_transformers_and_speculation_equals_plain(vlm):
    folder, reference, _, model, pixels, ids = vlm
    embeds = prompt_embeds(model.vision, ids, list(pixels))
    with torch.no_grad():
        out = reference.generate(input_ids=torch.tensor([ids]), pixel_values=pixels[None], max_new_tokens=24,
                                 do_sample=False, min_new_tokens=24)
    want = out[0, len(ids):].tolist()
    plain = [c.token_ids for c in generate_ids(model, _requests(ids, embeds), set())]
    assert plain == [want]
    assert [c.token_ids for c in generate_ids(model, _requests(ids, None), set())] != plain  # images change it
    for drafter, tree in (("suffix", "chain"), (f"draft-model:{folder}", "static:2,2"), ("early-exit:1", "static:2,2")):
        speculator = Speculator.build(SpecOptions(drafter, tree, "fixed:3"), model, folder)
        done = generate_ids(model, _requests(ids, embeds), set(), speculation=speculator)
        assert [c.token_ids for c in done] == plain, drafter


def test_batched_and_chunked_prefill_in_the_engine(vlm):
    """Three prompts in one engine, prefilled in one forward (each batch row's image rows at its own
    offsets) or 7 tokens a step (chunks that cut through the image rows): each gives its own run's
    tokens."""
    _, _, _, model, pixels, ids = vlm
    embeds = [prompt_embeds(model.vision, ids, list(pixels)), None, prompt_embeds(model.vision, ids, list(pixels.flip(0)))]
    solo = [generate_ids(model, _requests(ids, e, 12), set())[0].token_ids for e in embeds]
    assert solo[0] != solo[2]
    for chunk in (None, 7):
        engine = EngineLoop(model, set(), None, max_running=3, max_len=64, chunk_size=chunk)
        assert [c.token_ids for c in engine.run_all([_requests(ids, e, 12)[0] for e in embeds])] == solo, chunk


def test_block_drafter_reads_the_fused_hidden_states(vlm):
    """A DFlash head (random) with GLANCE's budget tree: the prompt's hidden states it is given are
    transformers' with the image rows in, and greedy speculation equals plain."""
    _, reference, _, model, pixels, ids = vlm
    embeds = prompt_embeds(model.vision, ids, list(pixels))
    head = random_head(hidden=64, vocab=VOCAB, layers=1, heads=4, kv_heads=2, block=4, taps=2, seed=3,
                       embed=model.embed, lm_head=model.lm_head, mask_token_id=0)
    shape = parse_shape("glance:8")
    drafter = DFlashDrafter(head, shape, head.config.taps(model.config.num_layers))
    seen = []
    start = drafter.start
    drafter.start = lambda seq_id, prompt, params=None, hidden=None, **kw: (seen.append(hidden),
                                                                             start(seq_id, prompt, params, hidden, **kw))
    spec = Speculator(SpecOptions("dflash:x", "glance:8", "fixed:3"), drafter, FixedController(3), shape)
    fast = [c.token_ids for c in generate_ids(model, _requests(ids, embeds), set(), speculation=spec)]
    assert fast == [c.token_ids for c in generate_ids(model, _requests(ids, embeds), set())]
    taps = head.config.taps(model.config.num_layers)
    with torch.no_grad():
        states = reference(input_ids=torch.tensor([ids]), pixel_values=pixels[None],
                           output_hidden_states=True).hidden_states  # (embeddings, after layer 1, ...)
    want = torch.stack([states[layer][0, : len(ids) - 1] for layer in taps], dim=1)  # [T - 1, taps, E]
    assert seen[0].shape == want.shape
    assert torch.allclose(seen[0], want, atol=1e-4, rtol=1e-4)


def test_smolvlm_layout_is_the_same_family(tmp_path):
    reference = _save(tmp_path, arch="SmolVLM", seed=2)
    model = load_decoder(tmp_path, "cpu", torch.float32)
    torch.manual_seed(3)
    pixels = torch.randn(1, 3, 32, 32)
    ids = [5, 6, AROUND, GLOBAL, *[IMAGE] * 4, AROUND, 7, 8, 9]
    got = _our_logits(model, ids, prompt_embeds(model.vision, ids, list(pixels)), [0, 3, len(ids)])
    assert torch.allclose(got, _reference_logits(reference, ids, pixels), atol=1e-4, rtol=1e-4)


def _cli(capsys, *args):
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_generate_with_an_image_file_gives_transformers_tokens(vlm, tmp_path, capsys):
    """The issue's done-when: `outrider generate --image` answers transformers' greedy tokens, plain
    and with a drafter. The PNG is read by Pillow and preprocessed by us (read_pixels); transformers
    gets the same pixel tensor."""
    Image = pytest.importorskip("PIL.Image")
    folder, reference, tokenizer, model, _, _ = vlm
    torch.manual_seed(4)
    png = tmp_path / "image.png"
    Image.fromarray((torch.rand(40, 48, 3) * 255).to(torch.uint8).numpy()).save(png)
    pixels = read_pixels(png, model.config.vision, folder)
    assert pixels.shape == (3, 32, 32) and -1.0 <= float(pixels.min()) and float(pixels.max()) <= 1.0
    prompt = "w5 w6 w7"
    runs = {}
    for extra in ((), ("--drafter", "suffix")):
        code, out, err = _cli(capsys, prompt, "--model", str(folder), "--image", str(png), "--chat", "--json",
                              "--max-new-tokens", "16", "--dtype", "float32", *extra)
        assert code == 0, err
        runs[extra] = json.loads(out)["token_ids"]
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                          "text": prompt}]}], add_generation_prompt=True, tokenize=False)
    ids = expand(tokenizer(text, add_special_tokens=False)["input_ids"], model.config.vision, tokenizer)
    assert ids.count(IMAGE) == 4 and ids[ids.index(AROUND) + 1] == GLOBAL
    processor = tf.Idefics3Processor(image_processor=tf.Idefics3ImageProcessorPil(
        do_image_splitting=False, size={"longest_edge": 32}, max_image_size={"longest_edge": 32}),
        tokenizer=tokenizer, image_seq_len=4)  # the image tokens transformers' processor writes: ours
    assert processor(text=[text], images=[[Image.open(png)]], add_special_tokens=False)["input_ids"][0] == ids
    with torch.no_grad():
        out = reference.generate(input_ids=torch.tensor([ids]), pixel_values=pixels[None, None], max_new_tokens=16,
                                 do_sample=False, eos_token_id=2)
    want = out[0, len(ids):].tolist()
    assert runs[()] == want and runs[("--drafter", "suffix")] == want


@pytest.mark.parametrize("shape", [(40, 48), (100, 60), (20, 20)])
def test_our_preprocessing_gives_the_processors_pixels_for_an_unsplit_image(vlm, tmp_path, shape):
    """read_pixels against transformers' Idefics3 image processor (without splitting), with the
    processor's settings read from the preprocessor_config.json it saves: a first resize of the
    longest edge to size.longest_edge, then to S x S, rescale and normalize."""
    Image = pytest.importorskip("PIL.Image")
    processor = tf.Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": 64},
                                             max_image_size={"longest_edge": 32}, image_mean=[0.4, 0.5, 0.6],
                                             image_std=[0.3, 0.2, 0.25])
    processor.save_pretrained(tmp_path)
    torch.manual_seed(5)
    png = tmp_path / "image.png"
    Image.fromarray((torch.rand(*shape, 3) * 255).to(torch.uint8).numpy()).save(png)
    want = processor(images=[[Image.open(png)]], return_tensors="pt")["pixel_values"][0, 0]  # [3, 32, 32]
    assert torch.allclose(read_pixels(png, vlm[3].config.vision, tmp_path), want, atol=1e-5)


def test_a_split_image_gives_transformers_processor_inputs_and_tokens(vlm, tmp_path):
    """With the processor's do_image_splitting (a preprocessor_config.json in the folder), a 70 x 50
    image becomes 2 x 2 tiles and the whole image: our tokens and tiles equal transformers'
    processor's, and LLM.generate(images=) answers transformers' greedy tokens on them."""
    import shutil

    from outrider import LLM

    Image = pytest.importorskip("PIL.Image")
    folder, reference, tokenizer, model, _, _ = vlm
    shutil.copytree(folder, tmp_path / "m")
    image_processor = tf.Idefics3ImageProcessorPil(do_image_splitting=True, size={"longest_edge": 64},
                                                   max_image_size={"longest_edge": 32})
    image_processor.save_pretrained(tmp_path / "m")
    torch.manual_seed(6)
    png = tmp_path / "image.png"
    Image.fromarray((torch.rand(50, 70, 3) * 255).to(torch.uint8).numpy()).save(png)
    ours = read_image(png, model.config.vision, tmp_path / "m")
    assert (ours.rows, ours.cols, ours.tiles.shape[0]) == (2, 2, 5)
    text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "image"}, {"type": "text",
                                          "text": "w5 w6"}]}], add_generation_prompt=True, tokenize=False)
    processor = tf.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4)
    inputs = processor(text=[text], images=[[Image.open(png)]], add_special_tokens=False, return_tensors="pt")
    assert torch.allclose(ours.tiles, inputs["pixel_values"][0], atol=1e-5)
    llm = LLM(str(tmp_path / "m"), dtype="float32", prefix_cache_mb=0)
    ids, embeds = llm.encode_images("w5 w6", [png], chat=True)
    assert ids == inputs["input_ids"][0].tolist() and ids.count(IMAGE) == 20 and GRID + 4 in ids  # <row_2_col_2>
    with torch.no_grad():
        out = reference.generate(**inputs, max_new_tokens=12, do_sample=False, eos_token_id=2)
    assert llm.generate("w5 w6", 12, chat=True, images=png).token_ids == out[0, len(ids):].tolist()


def test_llm_generate_takes_images_a_prompt(vlm, tmp_path):
    """LLM.generate over a list of prompts with one images entry a prompt (an image, a list, None)
    gives each prompt's own answer; a list of the wrong length is refused in one line."""
    from outrider import LLM

    folder, _, _, model, pixels, _ = vlm
    llm = LLM(str(folder), dtype="float32", prefix_cache_mb=0)
    prompts, images = ["w5 w6", "w7 <image> w8 <image> w9", "w5 w6"], [pixels[0], list(pixels), None]
    together = [c.token_ids for c in llm.generate(prompts, 10, images=images)]
    alone = [llm.generate(p, 10, images=i).token_ids for p, i in zip(prompts, images)]
    assert together == alone and together[0] != together[2]
    with pytest.raises(ConfigError, match="one entry a prompt"):
        llm.generate(prompts, 4, images=[pixels[0]])
    with pytest.raises(ConfigError, match="2 <image> markers for 1 image"):
        llm.generate("w5 <image> <image>", 4, images=pixels[0])


def test_one_line_refusals(vlm, tmp_path, capsys):
    import numpy as np

    folder = vlm[0]
    assert main(["models", "check", str(folder)]) == 0
    assert "a vision tower (2 layers, 32 x 32 tiles of 4 image tokens)" in capsys.readouterr().out
    code, _, err = _cli(capsys, "w5", "--model", str(folder), "--image", str(tmp_path / "missing.png"))
    assert code == 2 and err.strip().count("\n") == 0 and "no such file" in err
    bad = tmp_path / "small.npy"
    np.save(bad, np.zeros((3, 16, 16), dtype=np.float32))
    code, _, err = _cli(capsys, "w5", "--model", str(folder), "--image", str(bad), "--dtype", "float32")
    assert code == 2 and "[3, 32, 32]" in err and err.strip().count("\n") == 0
    text_only = make_tiny("llama", tmp_path / "llama")
    add_tokenizer(text_only)
    capsys.readouterr()  # transformers' progress lines while saving it
    good = tmp_path / "good.npy"
    np.save(good, np.zeros((3, 32, 32), dtype=np.float32))
    code, _, err = _cli(capsys, "w5", "--model", str(text_only), "--image", str(good), "--dtype", "float32")
    assert code == 2 and "is a text model" in err and err.strip().count("\n") == 0
    model = vlm[3]
    with pytest.raises(ConfigError, match="image tokens for 1 image"):
        prompt_embeds(model.vision, [5, IMAGE, 6], [torch.zeros(3, 32, 32)])
    with pytest.raises(ConfigError, match="last token"):
        prompt_embeds(model.vision, [5, *[IMAGE] * 4], [torch.zeros(3, 32, 32)])
    with pytest.raises(ModelError, match="quantized|not supported yet for a vision-language"):
        load_decoder(folder, "cpu", "q8_0")
