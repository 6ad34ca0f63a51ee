"""The fuzz of `outrider serve` (scripts/fuzz_serve.py), a smoke version: schemathesis against the
server's own OpenAPI schema and a few hundred hypothesis-drawn requests on a tiny model, NaN
logits injected for some prompts; no 500 but theirs, every answer fits the schema, every bad
field is refused naming it, and the server is healthy and exact afterwards. The full run
(thousands of requests) is the script's default: see docs/serving.md."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_script():
    spec = importlib.util.spec_from_file_location("fuzz_serve", ROOT / "scripts" / "fuzz_serve.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_fuzz_smoke_on_a_tiny_model(tiny_folders, tmp_path):
    fuzz = load_script()
    # a short context and queue bound what one generated request may cost (n up to 64 of 48 tokens)
    options = dict(drafter="ngram", controller="fixed:3", max_running=16, max_model_len=48, max_queue=64,
                   chunk_size=16, device="cpu", threads=1)
    result = fuzz.fuzz(str(tiny_folders["llama"]), requests=96, examples=6, phases="examples,fuzzing",
                       concurrency=8, seconds=120, seed=1, faults=("nan",), server_options=options,
                       out_dir=tmp_path, log=lambda *a: None)
    assert result["ok"], "\n".join(result["failures"])
    assert result["hypothesis_requests"] == 96 and result["schemathesis"]["generated"] >= 6
    statuses = result["hypothesis_statuses"]
    assert statuses.get(200, 0) >= 30 and statuses.get(400, 0) >= 8
    assert result["injected_faults_answered"] >= 1


def test_the_schema_and_the_checks_agree_on_what_is_valid(tiny_folders):
    """Bodies drawn from the valid strategies fit the published request schema, and bodies with
    one bad field do not (unless the field is bad only across fields, such as max_tokens beyond
    the context): the schema says what the field-by-field checks say."""
    import jsonschema_rs

    from outrider.serve.schema import request_models

    fuzz = load_script()
    completion, chat = (m.model_json_schema() for m in request_models(96))
    validators = {False: jsonschema_rs.validator_for(completion), True: jsonschema_rs.validator_for(chat)}
    items = fuzz.draw_items(120, 96, 48, seed=2)
    checked = 0
    for is_chat, body, expect, raw in items:
        if raw is not None:
            continue
        clean = {k: v for k, v in body.items() if v is not None}
        valid = validators[is_chat].is_valid(clean)
        if expect == ("ok",):
            assert valid, clean
        elif expect[1] not in ("max_tokens", "n", "top_logprobs"):  # rules across fields
            assert not valid, (expect, clean)
        checked += 1
    assert checked > 90
