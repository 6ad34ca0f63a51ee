"""The bench configuration: models, workloads and methods, from one TOML file.

    models = ["smollm2-135m-instruct"]
    workloads = ["humaneval", "toolcall", "code-edit"]     # or "jsonl:my_prompts.jsonl"
    prompts = 3                     # per workload (optional: all)
    max_new_tokens = 64             # optional: each workload's default otherwise
    temperature = 1.0               # optional: sample (0, the default, is greedy; bench/sampling.py),
    top_p = 1.0                     #   with top-p and a run seed; audited by frequencies (bench/audit.py:
    seed = 0                        #   audit_samples, audit_positions, audit_context, audit_batch,
                                    #   audit_workloads: default the first workload)

    [[method]]                      # ours: a drafter, a tree shape and a controller
    name = "suffix"
    drafter = "suffix"
    controller = "fixed:6"

    [[method]]                      # a peer, run on the same model and prompts
    name = "transformers"
    peer = "transformers"           # transformers | transformers-assisted | transformers-prompt-lookup
                                    # | llama.cpp | llama.cpp-prompt-lookup
                                    # | llama-server[:SPEC_TYPE] (llama_server.py)
    [[method]]                      # a block drafter's block refiners (`--refiner`): chained in order
    name = "dflash-cure"
    drafter = "dflash:smollm2-135m-instruct"
    refiner = "cure,retrace"
    tree = "ddtree:12"

    [[method]]                      # a verifier by name (spec/verifiers.py): sampling only
    name = "resispec-lossy"
    drafter = "eagle3:smollm2-135m-instruct"
    tree = "sampled:3,2,1"
    verifier = "resispec-lossy"     # lossy: audited, expected to fail, never fails the run

    [[method]]
    name = "draft-0.5b"
    drafter = "draft-model:qwen2.5-coder-0.5b-instruct"
    models = ["qwen2.5-coder-1.5b-instruct"]   # run only for these targets

Our autoregressive baseline is always run first and is not listed; at least one [[method]] is
needed. Everything here is checked
before any model is loaded; errors name the file and, where there is one, the line.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import ConfigError
from ..engine.speculator import SpecOptions
from . import llama_server

PEERS = ("transformers", "transformers-assisted", "transformers-prompt-lookup", "llama.cpp",
         "llama.cpp-prompt-lookup")
METHOD_KEYS = {"name", "drafter", "refiner", "tree", "controller", "verifier", "peer", "assistant", "lookup", "models",
               "head"}
# temperature, top_p, seed and the audit_* keys: a bench that samples (bench/sampling.py, bench/audit.py)
SAMPLING_KEYS = {"temperature", "top_p", "seed", "audit_samples", "audit_positions", "audit_context", "audit_batch",
                 "audit_workloads"}
TOP_KEYS = {"models", "workloads", "prompts", "max_new_tokens", "threads", "dtype", "kv_dtype",
            "method", "expert_budget"} | SAMPLING_KEYS
PRESETS = Path(__file__).parent / "presets"


@dataclass(frozen=True)
class Method:
    name: str
    line: int  # where its [[method]] table starts in the file (0 when unknown)
    spec: SpecOptions | None = None  # ours
    peer: str | None = None  # a peer's kind
    assistant: str | None = None  # transformers-assisted: the draft model
    lookup: int = 10  # prompt lookup peers: tokens per lookup
    models: tuple[str, ...] = ()  # empty: every model
    head: str | None = None  # llama-server:draft-eagle3|dflash|dspark: our head, exported as GGUF

    @property
    def kind(self) -> str:
        return "peer" if self.peer else "ours"

    @property
    def label(self) -> str:
        if self.spec:
            verifier = f", {self.spec.verifier}" if self.spec.verifier else ""
            return f"{self.name} ({self.spec.drafter}, {self.spec.tree}, {self.spec.controller}{verifier})"
        extra = f", assistant {self.assistant}" if self.assistant else ""
        extra += f", head {self.head}" if self.head else ""
        return f"{self.name} (peer: {self.peer}{extra})"

    def runs_on(self, model: str) -> bool:
        return not self.models or model in self.models


@dataclass(frozen=True)
class BenchConfig:
    source: str
    models: tuple[str, ...]
    workloads: tuple[str, ...]
    methods: tuple[Method, ...]
    prompts: int | None = None
    max_new_tokens: int | None = None
    threads: int | None = None
    dtype: str | None = None  # the targets' --dtype; None: each model's default (loader.auto_dtype)
    raw: dict = field(default_factory=dict)  # the file's TOML, with what overrides it folded in (with_overrides)
    kv_dtype: str | None = None  # the targets' --kv-dtype; None: the compute dtype
    preset: str | None = None  # the preset's name when the file is one
    temperature: float | None = None  # None or 0: greedy (bench/sampling.py)
    top_p: float | None = None  # None: 1 (off)
    seed: int | None = None  # the run seed each prompt's seed derives from (None: 0)
    audit_samples: int | None = None  # the distributional audit's sizes (None: bench/audit.py's defaults)
    audit_positions: int | None = None
    audit_context: int | None = None  # 0: the whole prompt
    audit_batch: int | None = None
    audit_workloads: tuple[str, ...] | None = None  # None: the first workload
    # "FRACTION[,store=mmap|direct]": every method with the routed experts behind a store of that
    # share (bench/expert_budget.py); None: every expert resident
    expert_budget: str | None = None


# The settings a command line can override, by key: the flag that does.
FLAGS = {"models": "--model", "workloads": "--workload", "prompts": "--prompts",
         "max_new_tokens": "--max-new-tokens", "threads": "--threads", "dtype": "--dtype", "kv_dtype": "--kv-dtype",
         "temperature": "--temperature", "top_p": "--top-p", "seed": "--seed", "audit_samples": "--audit-samples",
         "audit_positions": "--audit-positions", "audit_context": "--audit-context", "audit_batch": "--audit-batch",
         "audit_workloads": "--audit-workload", "expert_budget": "--expert-budget"}


def with_overrides(config: BenchConfig, overrides: dict) -> BenchConfig:
    """`config` with some of FLAGS' settings replaced, in its fields and in `raw` alike, so that
    what a run records (results.json's config, run.json's settings) is what ran."""
    raw = dict(config.raw)
    for key, value in overrides.items():
        raw[key] = list(value) if isinstance(value, tuple) else value
    fields_ = {key: tuple(value) if isinstance(value, list) else value for key, value in overrides.items()}
    if SAMPLING_KEYS & set(overrides):  # checked as the file's keys are: one line naming the flag
        try:
            fields_.update(_sampling(raw, "the command line"))
        except ConfigError as err:
            raise ConfigError(str(err).replace("the command line: ", "--").replace("--top_p", "--top-p")
                              .replace("--audit_", "--audit-")) from None
    return replace(config, raw=raw, **fields_)


def preset_names() -> list[str]:
    """The presets shipped in the presets folder, by name."""
    return sorted(p.stem for p in PRESETS.glob("*.toml"))


def preset_help() -> str:
    """`bench --preset`'s help: every preset in the folder with its `# summary:` line."""
    parts = []
    for name in ["quick"] + [n for n in preset_names() if n != "quick"]:
        summary = next((line.partition("# summary:")[2].strip()
                        for line in (PRESETS / f"{name}.toml").read_text().splitlines()
                        if line.startswith("# summary:")), "")
        parts.append(f"{name} ({summary})" if summary else name)
    return "; ".join(parts)


def load_preset(name: str) -> BenchConfig:
    return replace(load_config(preset_path(name)), preset=name)


def preset_path(name: str) -> Path:
    path = PRESETS / f"{name}.toml"
    if not path.exists():
        known = ", ".join(preset_names())
        raise ConfigError(f"unknown preset '{name}': known presets are {known}")
    return path


def load_config(path: str | Path) -> BenchConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read it ({err.strerror}); give a methods TOML file") from None
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: malformed TOML: {err}") from None
    return parse_config(raw, str(path), _method_lines(text))


def parse_config(raw: dict, source: str, lines: list[int] | None = None) -> BenchConfig:
    unknown = set(raw) - TOP_KEYS
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(TOP_KEYS))}")
    models = _strings(raw.get("models", ["smollm2-135m-instruct"]), f"{source}: models")
    workloads = _strings(raw.get("workloads", ["humaneval"]), f"{source}: workloads")
    methods = []
    for i, table in enumerate(raw.get("method", [])):
        line = lines[i] if lines and i < len(lines) else 0
        methods.append(_method(table, f"{source}:{line}" if line else source, line))
    names = [m.name for m in methods]
    dupes = {n for n in names if names.count(n) > 1}
    if dupes:
        raise ConfigError(f"{source}: method name(s) used twice: {', '.join(sorted(dupes))}")
    if "autoregressive" in names:
        raise ConfigError(f"{source}: 'autoregressive' is the built-in baseline; give your method another name")
    numbers = [_positive(raw.get(key), f"{source}: {key}") for key in ("prompts", "max_new_tokens", "threads")]
    if not methods:
        raise ConfigError(f"{source}: no [[method]] table; a methods file needs at least one, with a name and "
                          f"a drafter or a peer (e.g. [[method]] name = \"ngram\" drafter = \"ngram\"; "
                          f"see outrider/bench/presets/quick.toml)")
    dtype = raw.get("dtype")
    if dtype is not None:
        from ..weights.loader import parse_dtype

        if not isinstance(dtype, str):
            raise ConfigError(f"{source}: dtype must be a string such as \"float32\" or \"q4\", got {dtype!r}")
        parse_dtype(dtype)  # an unknown name is refused here, before anything loads
    kv_dtype = raw.get("kv_dtype")
    if kv_dtype is not None:
        from ..weights.loader import parse_kv_dtype

        parse_kv_dtype(str(kv_dtype))
    budget = raw.get("expert_budget")
    if budget is not None:
        from .expert_budget import ExpertBudget

        try:
            budget = str(ExpertBudget.parse(budget))
        except ConfigError as err:
            raise ConfigError(f"{source}: expert_budget: {str(err).partition(': ')[2]}") from None
    return BenchConfig(source, tuple(models), tuple(workloads), tuple(methods), *numbers, dtype, raw, kv_dtype,
                       **_sampling(raw, source), expert_budget=budget)


def _sampling(raw: dict, source: str) -> dict:
    """The file's sampling keys, checked (bench/sampling.py): temperature, top_p, seed, audit_*."""
    from .sampling import BenchSampling

    out = {}
    for key in ("temperature", "top_p"):
        value = raw.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"{source}: {key} must be a number, got {value!r}")
        out[key] = None if value is None else float(value)
    seed = raw.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ConfigError(f"{source}: seed must be an integer >= 0, got {seed!r}")
    out["seed"] = seed
    for key in ("audit_samples", "audit_positions", "audit_batch"):
        out[key] = _positive(raw.get(key), f"{source}: {key}")
    audited = raw.get("audit_workloads")
    out["audit_workloads"] = None if audited is None else tuple(_strings(audited, f"{source}: audit_workloads"))
    workloads = _strings(raw.get("workloads", ["humaneval"]), f"{source}: workloads")
    for name in out["audit_workloads"] or ():
        if name not in workloads:
            raise ConfigError(f"{source}: audit_workloads names '{name}', which is not one of the workloads "
                              f"({', '.join(workloads)})")
    context = raw.get("audit_context")
    if context is not None and (isinstance(context, bool) or not isinstance(context, int) or context < 0):
        raise ConfigError(f"{source}: audit_context must be an integer >= 0 (0: the whole prompt), got {context!r}")
    out["audit_context"] = context
    try:
        BenchSampling(out["temperature"] or 0.0, 1.0 if out["top_p"] is None else out["top_p"], seed or 0).check()
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    return out


def _method(table: dict, where: str, line: int) -> Method:
    if not isinstance(table, dict) or "name" not in table or not isinstance(table["name"], str):
        raise ConfigError(f"{where}: a [[method]] needs a name = \"...\"")
    name = table["name"]
    unknown = set(table) - METHOD_KEYS
    if unknown:
        raise ConfigError(f"{where}: method '{name}' has unknown key(s) {', '.join(sorted(unknown))}; "
                          f"known: {', '.join(sorted(METHOD_KEYS))}")
    models = tuple(_strings(table.get("models", []), f"{where}: method '{name}' models"))
    if "peer" in table:
        peer = table["peer"]
        if isinstance(peer, str) and llama_server.is_kind(peer):
            try:
                spec_type, _ = llama_server.parse_kind(peer)
            except ConfigError as err:
                raise ConfigError(f"{where}: method '{name}': {err}") from None
            if spec_type in llama_server.NEEDS_DRAFT and not table.get("assistant"):
                raise ConfigError(f"{where}: method '{name}': {peer} needs assistant = \"MODEL\" (the draft model)")
            if (spec_type in llama_server.HEAD_KINDS) != isinstance(table.get("head"), str):
                raise ConfigError(f"{where}: method '{name}': head = \"NAME\" (a shipped head or a head folder) goes "
                                  f"with llama-server:{'|'.join(llama_server.HEAD_KINDS)} and only there")
        elif "head" in table:
            raise ConfigError(f"{where}: method '{name}': head goes with llama-server's learned draft-* types only")
        elif peer not in PEERS:
            raise ConfigError(f"{where}: method '{name}': unknown peer '{peer}'; known: {', '.join(PEERS)}, "
                              f"llama-server[:TYPE]")
        if "drafter" in table:
            raise ConfigError(f"{where}: method '{name}' has both peer and drafter; a method is one or the other")
        assistant = table.get("assistant")
        if peer == "transformers-assisted" and not assistant:
            raise ConfigError(f"{where}: method '{name}': transformers-assisted needs assistant = \"MODEL\"")
        lookup = table.get("lookup", 10)
        if not isinstance(lookup, int) or lookup < 1:
            raise ConfigError(f"{where}: method '{name}': lookup must be a positive integer")
        return Method(name, line, peer=peer, assistant=assistant, lookup=lookup, models=models, head=table.get("head"))
    if "head" in table:
        raise ConfigError(f"{where}: method '{name}': head goes with a llama-server peer (our drafters name theirs)")
    if "drafter" not in table:
        raise ConfigError(f"{where}: method '{name}' needs a drafter = \"...\" or a peer = \"...\"")
    try:
        from ..drafters.refiners import with_refiners

        verifier = table.get("verifier")  # a verifier by name (spec/verifiers.py); a lossy one is audited as such
        spec = SpecOptions(with_refiners(str(table["drafter"]), table.get("refiner")), str(table.get("tree", "chain")),
                           str(table.get("controller", "fixed:4")),
                           verifier=None if verifier is None else str(verifier)).check()
    except ConfigError as err:
        raise ConfigError(f"{where}: method '{name}': {err}") from None
    return Method(name, line, spec=spec, models=models)


def _method_lines(text: str) -> list[int]:
    return [i + 1 for i, line in enumerate(text.splitlines()) if line.strip().startswith("[[method]]")]


def _strings(value, where: str) -> list[str]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{where} must be a list of names")
    return value


def _positive(value, where: str) -> int | None:
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{where} must be a positive integer, got {value!r}")
    return value
