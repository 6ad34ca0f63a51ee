"""`outrider bench`: every method on the same model and prompts, each prompt's methods back to back.

Order of work, so that bad input fails before anything heavy happens:
    1. parse the methods TOML (methods.py); check the out folder (store.check_out);
    2. load the workloads (data, fetched once); pull what each drafter needs (its registry
       entry says), then check that each drafter fits each model (tokenizer, layers);
    3. open the run's store: a fresh run saves what it is (results.identity); --resume checks
       that it is the same run and reads the prompts finished before;
    4. per model (loaded only if a prompt is left): per workload run every unfinished prompt
       through every method back to back (interleaved, so a slow drift of the machine hits all
       methods alike), saving the prompt's line as soon as it is done. Peers run each in a child
       process (peer_process.py): one that crashes is saved as failed, and the run goes on
       without it. A prompt finished in an earlier session is given to each method again
       (_replay), so that it drafts the rest as an uninterrupted run would;
    5. the results, lossless audit included (each of our methods' greedy output against our
       autoregressive output), built from the saved prompts (results.assemble).

A bench that samples (temperature > 0, bench/sampling.py) seeds each prompt's requests, runs the
transformers and llama-server peers sampled too (the other peers stay greedy, said in their
note), and after every workload's timed prompts on a model runs the distributional audit
(bench/audit.py) of each of our methods, saved as one line per (model, workload) so that
--resume keeps it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from ..weights.tokenizer import eos_ids_of
from ..errors import ConfigError
from ..catalog.composed import COMPOSED, composed_path, is_composed
from ..catalog.packages import CATALOG
from ..catalog.pull import is_present, pull
from ..catalog.resolve import resolve_model
from ..models.config import ModelConfig
from ..weights.loader import auto_dtype, load_decoder, parse_dtype, parse_kv_dtype
from ..engine.speculator import Speculator
from .methods import BenchConfig
from .expert_budget import BudgetTier, ExpertBudget
from .peers import PeerFailed, PeerUnavailable, make_peer
from .audit import BATCH, CONTEXT, POSITIONS, SAMPLES, audit_prompt
from .peers import samples as peer_samples
from .results import BASELINE, assemble, identity, lossy_methods, method_names, model_facts
from .sampling import BenchSampling
from .results import needs_exit_failure, write_results  # noqa: F401 (the CLI's imports)
from .runner import PromptRun, first_difference, run_ours
from .store import BenchInterrupted, RunStore, check_out
from .workloads import Workload, load_workload


@dataclass
class Plan:
    config: BenchConfig
    workloads: list[Workload]
    model_paths: dict[str, Path]


def plan(config: BenchConfig, log=print) -> Plan:
    """Everything that can be checked before a model is loaded."""
    workloads = [load_workload(w, limit=config.prompts, max_new_tokens=config.max_new_tokens)
                 for w in config.workloads]
    params = BenchSampling.of(config).params()
    peers = [m.name for m in config.methods if m.peer]
    if config.expert_budget and peers:  # bench/expert_budget.py
        raise ConfigError(f"--expert-budget runs our methods' experts through a store; peer(s) {', '.join(peers)} run "
                          "their own models outside it: drop them (a methods file without peers) or the budget")
    for m in config.methods:  # what the temperature rules out (a sampled tree when greedy, a verifier unfit)
        if m.spec:
            try:
                m.spec.check_sampling(params)
                m.spec.verifier_choice(params)
            except ConfigError as err:
                where = f"{config.source}:{m.line}" if m.line else config.source
                raise ConfigError(f"{where}: method '{m.name}': {err}") from None
    needed = list(config.models)
    for m in config.methods:
        if not any(m.runs_on(model) for model in config.models):  # a method for another target: nothing to pull
            continue
        for extra in (m.spec.models_needed() if m.spec else ()) + ((m.assistant,) if m.assistant else ()):
            if extra not in needed:
                needed.append(extra)
    paths = {}
    for name in needed:
        if (name in CATALOG and not is_present(name)) or (name in COMPOSED and not is_composed(composed_path(name))):
            log(f"pulling {name} (once)")
            pull(name, log=log)
        paths[name] = resolve_model(name)
    for model in config.models:
        target_config = ModelConfig.load(paths[model])
        for m in config.methods:
            if not m.runs_on(model) or not m.spec:
                continue
            where = f"{config.source}:{m.line}" if m.line else config.source
            reason = m.spec.misfit(target_config, paths[model])
            if reason:
                raise ConfigError(f"{where}: method '{m.name}' does not fit {model}: {reason}; "
                                  f"limit it with models = [...]")
    return Plan(config, workloads, paths)


def run_bench(p: Plan, threads: int | None = None, log=print, progress: bool = True,
              out: Path | None = None, resume: bool = False) -> dict:
    """Run every prompt of the plan, save each as it finishes, and return the results.

    out: the folder that keeps the finished prompts (store.py); None keeps them in memory.
    resume: finish the unfinished run in `out` (same settings, or a ConfigError says which differ).
    Ctrl-C raises BenchInterrupted once the bar is closed; the finished prompts stay saved."""
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()  # a peer's "Loading weights" bar would break into ours
    threads = threads or p.config.threads or torch.get_num_threads()
    sampling = BenchSampling.of(p.config)
    torch.set_num_threads(threads)
    if out is not None:
        check_out(out, resume)
    facts = {name: model_facts(name, path) | {"dtype": target_dtype(p, path), "kv_dtype": p.config.kv_dtype or "float32"}
             for name, path in p.model_paths.items()}
    store = RunStore.open(out, identity(p, facts, threads), resume)
    prompts = sum(len(w.prompts) for w in p.workloads) * len(p.config.models)
    if store.prompts:
        log(f"resuming: {len(store.prompts)} of {prompts} prompts were finished before")
    done = sum(len(line["runs"]) for line in store.prompts.values())
    total = done + sum(len(method_names(p, model, store)) for model in p.config.models for w in p.workloads
                       for q in w.prompts if not store.done(model, w.name, q.id))  # the audit logs, not counted
    bar = tqdm(total=total, initial=done,
               disable=not progress, file=sys.stderr, dynamic_ncols=True)
    try:
        for model in p.config.models:
            _run_model(p, model, store, threads, bar, log, sampling)
    except KeyboardInterrupt:
        raise BenchInterrupted(len(store.prompts), prompts, out) from None
    finally:
        bar.close()
    return assemble(p, store, facts, threads)


def target_dtype(p: Plan, path: Path) -> str:
    """The dtype a target runs in: the config's, else the model's default (loader.auto_dtype)."""
    return p.config.dtype or auto_dtype(path) or "float32"


def _run_model(p: Plan, model: str, store: RunStore, threads: int, bar, log, sampling: BenchSampling) -> None:
    """Every unfinished prompt of every workload on `model`, then (sampling) every unfinished
    audit; the model loads only if something is left."""
    from transformers import AutoTokenizer

    if all(store.done(model, w.name, q.id) for w in p.workloads for q in w.prompts) and \
            (sampling.greedy or all(store.audited(model, w.name) for w in audited_workloads(p))):
        return
    path = p.model_paths[model]
    target = load_decoder(path, None, parse_dtype(target_dtype(p, path)), kv_dtype=parse_kv_dtype(p.config.kv_dtype))
    tok = AutoTokenizer.from_pretrained(str(path))
    eos = eos_ids_of(path, tok)
    peers: dict = {}
    try:
        _peers(p, model, store, threads, bar, log, peers, sampling)
        _run_workloads(p, model, store, target, tok, eos, path, peers, bar, log, sampling)
        if not sampling.greedy:
            _run_audits(p, model, store, target, tok, eos, path, bar, log, sampling)
    finally:
        for peer in peers.values():
            peer.close()
    del target


def _run_workloads(p: Plan, model: str, store: RunStore, target, tok, eos: set[int], path: Path, peers: dict,
                   bar, log, sampling: BenchSampling) -> None:
    params = None if sampling.greedy else sampling.params()
    tier = BudgetTier(ExpertBudget.parse(p.config.expert_budget), target, path) if p.config.expert_budget else None
    for w in p.workloads:
        if all(store.done(model, w.name, q.id) for q in w.prompts):
            continue
        ids = {q.id: encode_prompt(tok, w, q) for q in w.prompts}
        specs = {m.name: Speculator.build(m.spec, target, path) for m in p.config.methods
                 if m.spec and m.runs_on(model)}
        lossy = lossy_methods(p.config)  # a lossy verifier's differences are its own, not a failed audit
        run_ours(target, None, ids[w.prompts[0].id][:8], 2)  # warm-up
        for i, prompt in enumerate(w.prompts):
            saved = store.done(model, w.name, prompt.id)
            if saved:
                _replay(specs, target, ids[prompt.id], w.budget(prompt), eos, saved, sampling, w.name, prompt.id)
                continue
            runs: dict[str, PromptRun] = {}
            if tier is not None:  # what the prompt's prefill alone reads from a cold store, before any seed is set
                tier.prefill((w.name, prompt.id), lambda: run_ours(target, None, ids[prompt.id], 1, eos, params))
            for name in method_names(p, model, store):
                bar.set_description(f"{model} | {w.name} | {i + 1}/{len(w.prompts)} | {name}")
                seed = sampling.seed_torch(w.name, prompt.id)  # the same for every method of the prompt
                if name == BASELINE or name in specs:
                    spec, prompt_ids, budget = specs.get(name), ids[prompt.id], w.budget(prompt)
                    r = _budgeted(tier, (w.name, prompt.id),
                                  lambda: run_ours(target, spec, prompt_ids, budget, eos, params))
                else:
                    sampled = not sampling.greedy and peer_samples(p_method(p, name).peer)
                    try:
                        r = peers[name].run(ids[prompt.id], w.budget(prompt), *((seed,) if sampled else ()))
                    except PeerFailed as why:
                        _peer_failed(p, model, store, peers, name, f"{why} (on {w.name} prompt {prompt.id})", bar, log)
                        continue
                runs[name] = r
                bar.set_postfix_str(f"{len(r.output_ids) / max(r.seconds, 1e-9):.1f} tok/s")
                bar.update(1)
            base = runs[BASELINE].output_ids
            for name, r in runs.items():
                r.stats["first_difference"] = diff = first_difference(base, r.output_ids)
                if diff is not None and name in specs and sampling.greedy and name not in lossy:  # sampled: audit.py
                    log(f"LOSSLESS AUDIT FAILED: {name} on {w.name} {prompt.id} differs from "
                        f"autoregressive at output token {diff}")
            store.add_prompt(model, w.name, prompt.id, {
                name: {"output_ids": r.output_ids, "seconds": r.seconds, "stats": r.stats}
                for name, r in runs.items()})


def _budgeted(tier: BudgetTier | None, key, run) -> PromptRun:
    """run() as it is, or under the expert budget's store (a fresh one), with what its prompt's
    prefill alone reads (tier.prefill, measured before the prompt's methods) beside what it read."""
    if tier is None:
        return run()
    r = tier.run(run)
    r.stats["expert_prefill_bytes"] = tier.prefill_bytes[key]
    return r


def p_method(p: Plan, name: str):
    return next(m for m in p.config.methods if m.name == name)


def audited_workloads(p: Plan) -> list[Workload]:
    """The workloads whose first prompt the audit samples: audit_workloads, else the first."""
    names = p.config.audit_workloads or p.config.workloads[:1]
    return [w for w in p.workloads if w.name in names]


def audit_prompt_ids(ids: list[int], context: int) -> list[int]:
    """The audited prompt: its last `context` tokens (0: all of it)."""
    return list(ids[-context:]) if context else list(ids)


def _run_audits(p: Plan, model: str, store: RunStore, target, tok, eos: set[int], path: Path, bar, log,
                sampling: BenchSampling) -> None:
    """The distributional audit (bench/audit.py) of each workload's first prompt on `model`, with
    every method of ours built fresh (no state from the timed runs); saved a workload at a time."""
    c = p.config
    samples, positions, batch = c.audit_samples or SAMPLES, c.audit_positions or POSITIONS, c.audit_batch or BATCH
    context = CONTEXT if c.audit_context is None else c.audit_context
    for w in audited_workloads(p):
        if store.audited(model, w.name) or not w.prompts:
            continue
        prompt = w.prompts[0]
        ids = audit_prompt_ids(encode_prompt(tok, w, prompt), context)
        specs = {m.name: Speculator.build(m.spec, target, path) for m in c.methods if m.spec and m.runs_on(model)}
        bar.set_description(f"{model} | {w.name} | audit")
        result = audit_prompt(target, specs, ids, eos, sampling, w.name, prompt.id, samples, positions, log=log,
                              batch=batch)
        store.add_audit(model, w.name, result)


def _peer_failed(p: Plan, model: str, store: RunStore, peers: dict, name: str, reason: str, bar, log) -> None:
    """A peer that crashed: saved as failed on `model` (its row says why); the run goes on without it."""
    peers.pop(name).close()
    store.add_skipped(model, name, reason, failed=True)
    log(f"peer {name} failed on {model}: {reason}; the bench goes on without it")
    _uncount(p, model, store, bar)


def _uncount(p: Plan, model: str, store: RunStore, bar) -> None:
    """Take a peer that will not run on `model` off the bar: one run a prompt left."""
    bar.total -= sum(not store.done(model, w.name, q.id) for w in p.workloads for q in w.prompts)
    bar.refresh()


def _peers(p: Plan, model: str, store: RunStore, threads: int, bar, log, peers: dict,
           sampling: BenchSampling | None = None) -> None:
    """Start the peers that run on `model`, into `peers`. One that cannot run here is skipped (and
    saved as skipped); one that crashes while it loads is saved as failed; one that ran in an
    earlier part of this run must run now too."""
    skipped = store.skipped_on(model)
    for m in p.config.methods:
        if not m.peer or not m.runs_on(model):
            continue
        if m.name in skipped:
            log(f"skipping peer {m.name} on {model}: {skipped[m.name]}")
            continue
        try:
            sampled = sampling is not None and not sampling.greedy
            extra = {"sampling": (sampling.temperature, sampling.top_p)} if sampled and peer_samples(m.peer) else {}
            extra.update({"head": m.head} if m.head else {})
            peer = make_peer(m.peer, p.model_paths[model], assistant_path=p.model_paths.get(m.assistant),
                             lookup=m.lookup, threads=threads, **extra)
        except PeerUnavailable as why:
            if any(key[0] == model and m.name in line["runs"] for key, line in store.prompts.items()):
                raise ConfigError(f"peer {m.name} ran on {model} before this run was interrupted but cannot "
                                  f"run now ({why}); resume where it can run") from None
            store.add_skipped(model, m.name, str(why))
            log(f"skipping peer {m.name} on {model}: {why}")
            _uncount(p, model, store, bar)
            continue
        except PeerFailed as why:
            store.add_skipped(model, m.name, str(why), failed=True)
            log(f"peer {m.name} failed on {model}: {why}; the bench goes on without it")
            _uncount(p, model, store, bar)
            continue
        peers[m.name] = peer
        note = getattr(peer, "note", None)
        if sampled and not peer_samples(m.peer):  # said, not hidden: its row is greedy decoding
            note = ((note + "; ") if note else "") + "greedy: this peer does not sample in the bench (not audited)"
        if note and m.name not in store.notes_on(model):
            store.add_note(model, m.name, note)
            log(f"peer {m.name} on {model}: {note}")


# Drafters whose state across prompts is what start and finish show them (suffix's global tree),
# under controllers that keep nothing across prompts: a finished prompt is replayed by showing it.
SHOWN = {"ngram", "suffix", "draft-model"}
PER_PROMPT_CONTROLLERS = {"fixed", "adaptive"}


def _replay(specs: dict[str, Speculator], target, prompt_ids: list[int], budget: int, eos: set[int],
            saved: dict, sampling: BenchSampling | None = None, workload: str = "", prompt_id: str = "") -> None:
    """Give each method what a prompt finished in an earlier session gave it, so that it drafts the
    rest as in an uninterrupted run. A drafter in SHOWN under a per-prompt controller is shown the
    prompt as the loop shows it (start, then finish with prompt + output). Any other (a head that
    reads the target's features at start, the hybrid's running acceptance, a cost controller's
    measurements) runs the prompt again, its figures discarded: only a run builds that state."""
    for name, spec in specs.items():
        if spec.options.kind in SHOWN and spec.options.controller.partition(":")[0] in PER_PROMPT_CONTROLLERS:
            output = saved["runs"][name]["output_ids"]
            spec.drafter.start(0, list(prompt_ids))
            spec.drafter.finish(0, list(prompt_ids) + output)
        else:
            params = None
            if sampling is not None and not sampling.greedy:  # the same draws as the run it replays
                sampling.seed_torch(workload, prompt_id)
                params = sampling.params()
            run_ours(target, spec, prompt_ids, budget, eos, params)


def encode_prompt(tok, w: Workload, prompt) -> list[int]:
    """A workload prompt's token ids as the bench feeds them: chat workloads through the model's
    chat template (a plain text as one user message), others as plain text. Scripts that replay a
    workload outside the bench (scripts/*_counters.py, ooo_hints.py) call it too."""
    if w.chat:
        messages = prompt.messages or [{"role": "user", "content": prompt.text}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tok(text, add_special_tokens=False)["input_ids"]
    return tok(prompt.text)["input_ids"]
