"""`outrider check-head` catches what breaks a head (issue 43, item 7): copies of the shipped SmolLM2
heads, each with one deliberate corruption, fail with one line naming it; the untouched copies
pass. The four that passed as "conforms" before: a DFlash head with `layers.0.mlp.down_proj` zeroed
(the golden compared only tau), its block_size changed from 8 to 16, one of its tensors stored as
float16 among float32 ones, and an EAGLE-3 config without norm_before_residual; and a few more.

The copies carry a small golden measured here (one prompt, 8 tokens: the shipped goldens' 5 x 32
take a minute a head), so each check that re-measures runs in seconds."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from enumerate_law import one_thread
from safetensors.torch import load_file, save_file

from outrider.cli import main
from outrider.heads.dflash.export import write_record
from outrider.heads.golden import GoldenSettings, record, write_golden
from outrider.heads.eagle3.golden import measure
from outrider.heads.golden_compute import TOP, compare_computes, measured_part, recorded

SHIPPED = Path(__file__).parents[1] / "outrider" / "heads" / "shipped"
PROMPTS = ("def add(a, b):",)
SMALL = GoldenSettings(max_new_tokens=8)


@pytest.fixture(autouse=True, scope="module")
def single_thread():
    with one_thread():
        yield


def bare_copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy(src / name, dst / name)
    return dst


@pytest.fixture(scope="module")
def heads(tmp_path_factory, smollm2_path):
    """The shipped DFlash and EAGLE-3 heads, each with a small golden of its own."""
    root = tmp_path_factory.mktemp("corrupt")
    dflash = bare_copy(SHIPPED / "dflash" / "smollm2-135m-instruct", root / "dflash")
    write_record(dflash, "smollm2-135m-instruct", smollm2_path, SMALL, PROMPTS)
    eagle = bare_copy(SHIPPED / "eagle3" / "smollm2-135m-instruct", root / "eagle3")
    write_golden(eagle, record(measure(eagle, smollm2_path, SMALL, PROMPTS), "smollm2-135m-instruct",
                               smollm2_path, ["LlamaForCausalLM"]))
    return {"dflash": dflash, "eagle3": eagle}


def corrupt(src: Path, dst: Path, config_edit=None, tensor_edit=None) -> Path:
    shutil.copytree(src, dst)
    if config_edit:
        raw = json.loads((dst / "config.json").read_text())
        config_edit(raw)
        (dst / "config.json").write_text(json.dumps(raw))
    if tensor_edit:
        tensors = load_file(str(dst / "model.safetensors"))
        tensor_edit(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    return dst


def check(capsys, folder, target) -> tuple[int, list[str]]:
    status = main(["check-head", str(folder), "--target", str(target)])
    return status, capsys.readouterr().out.splitlines()


@pytest.mark.model
@pytest.mark.parametrize("kind", ["dflash", "eagle3"])
def test_the_untouched_copy_conforms(heads, smollm2_path, capsys, kind):
    status, out = check(capsys, heads[kind], smollm2_path)
    assert status == 0 and not [line for line in out if "FAIL" in line], out
    logits = next(line for line in out if line.startswith("golden logits"))
    assert " ok (" in logits and "slot argmaxes equal" in logits and "exact argmaxes" in logits
    golden = json.loads((heads[kind] / "outrider_golden.json").read_text())
    slots = {"dflash": 7, "eagle3": 4}[kind]
    assert golden["format"] == 2 and golden["computes"]["slots"] == slots
    assert len(golden["computes"]["argmax"][0]) == len(golden["computes"]["anchors"][0]) * slots > 0


def zero(name):
    return lambda t: t[name].zero_()


def to_fp16(name):
    def edit(t):
        t[name] = t[name].half()
    return edit


def scale(name, by):
    def edit(t):
        t[name] = (t[name].float() * by).to(t[name].dtype)
    return edit


CASES = [  # kind, check that FAILs, config edit, tensor edit, what its line says
    ("dflash", "golden logits", None, zero("layers.0.mlp.down_proj.weight"), "slot argmaxes differ from the golden"),
    ("dflash", "block size", lambda c: c.update(block_size=16), None,
     "block_size is 16 but the head was exported and its golden recorded with blocks of 8"),
    ("dflash", "tensors", None, to_fp16("layers.0.mlp.up_proj.weight"),
     "mixed float dtypes: layers.0.mlp.up_proj.weight float16 among 13 float32 tensors"),
    ("eagle3", "config fields", lambda c: c.pop("norm_before_residual"), None, "norm_before_residual is missing"),
    # more that a head can suffer
    ("dflash", "tensors", lambda c: c.update(torch_dtype="bfloat16"), None,
     "torch_dtype is bfloat16 but the tensors are float32"),
    ("eagle3", "golden logits", None, scale("fc.weight", 1.02), "logits move past the tolerance"),
    ("eagle3", "tensors", None, to_fp16("midlayer.self_attn.o_proj.weight"),
     "mixed float dtypes: midlayer.self_attn.o_proj.weight float16 among 12 bfloat16 tensors"),
]


@pytest.mark.model
@pytest.mark.parametrize("kind, name, config_edit, tensor_edit, expected", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[4][:24]}" for c in CASES])
def test_a_corrupted_copy_fails_in_one_line(heads, smollm2_path, tmp_path, capsys, kind, name, config_edit,
                                            tensor_edit, expected):
    bad = corrupt(heads[kind], tmp_path / "bad", config_edit, tensor_edit)
    status, out = check(capsys, bad, smollm2_path)
    assert status == 1
    failed = [line for line in out if "FAIL: " in line]
    assert failed and failed[0].startswith(name) and expected in failed[0], out
    if not name.startswith("golden"):  # a structural fault: its line alone, the golden not run
        assert len(failed) == 1, out
        assert any(line.startswith("golden tau") and "skipped" in line for line in out)
    else:  # the head runs but computes something else: tau may or may not move
        assert {line.split()[0] + " " + line.split()[1] for line in failed} <= {"golden logits", "golden tau"}
        assert "re-export" in failed[0]


def test_the_computes_rules():
    """Exact argmaxes on the same machine; elsewhere a golden token may lose a near tie (its logit
    within the tolerance of the new maximum) but not more; logits within atol + rtol |x|; NaN
    fails; other anchors or slots (a changed block size) fail."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 2, 10, generator=g) * 4  # [anchors, slots, V]

    def part(x, anchors=(5, 6, 7)):
        values, ids = x.sort(dim=-1, descending=True, stable=True)
        return measured_part("test", x.shape[1], [list(anchors)], [(values[..., :TOP], ids[..., :TOP])])

    golden = {"computes": recorded(part(logits), "float32")}
    assert compare_computes(golden, {"computes": part(logits)}, True)[0]
    best = logits.argmax(-1)
    tie = logits.clone()
    tie[0, 0, (best[0, 0] + 1) % 10] = logits[0, 0, best[0, 0]] + 5e-4  # another token wins by 5e-4
    assert compare_computes(golden, {"computes": part(tie)}, False)[0]
    ok, message = compare_computes(golden, {"computes": part(tie)}, True)
    assert not ok and message.startswith("1 of 6 slot argmaxes differ from the golden (first: prompt 0, "
                                         "position 5, slot 1")
    far = logits.clone()
    far[0, 0, (best[0, 0] + 1) % 10] = logits[0, 0, best[0, 0]] + 0.01
    assert not compare_computes(golden, {"computes": part(far)}, False)[0]
    moved = logits.clone()
    moved[2, 1] += 0.002  # every logit of one slot: the argmax stays, its logit moves by 2e-3
    ok, message = compare_computes(golden, {"computes": part(moved)}, True)
    assert not ok and "0 of 6 slot argmaxes differ" in message and "1 logits move past the tolerance" in message
    assert not compare_computes(golden, {"computes": part(torch.full_like(logits, float("nan")))}, False)[0]
    ok, message = compare_computes(golden, {"computes": part(logits[:, :1])}, False)
    assert not ok and "1 slot(s)" in message and "where the golden has 2" in message
