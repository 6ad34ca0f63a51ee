"""Structured outputs: a grammar (a JSON schema, any JSON object, Lark, a regex) constrains the
target's distribution, in plain decoding and in verification alike, with llguidance's matcher.

At each node of a draft tree the grammar's state is the one after the committed tokens and the
node's path; the node's row of logits keeps only the tokens allowed there (the others get
-inf), so p is the constrained distribution and the verifiers stay exact against it. Two
things make drafting grammar-aware (`Request.grammar_drafting`):
- pruning: a draft node whose token the grammar forbids at its parent is cut, with its subtree,
  before the forward (fewer verify rows). Only where that changes nothing: for greedy and
  tree-walk verification (a forbidden token is never the argmax, never drawn from p). A sampled
  chain's rejection of a forbidden draft draws the recovered token from the residual, not from
  p, so drafts drawn from q are left whole there and their forbidden nodes are rejected;
- forced tokens: where the grammar allows a single continuation (a JSON key, a closing brace),
  those tokens are proposed as a chain in place of the drafter's tree. p is a point mass on
  each, so they are accepted by every verifier (their q, where one is needed, is the same point
  mass): free tokens, one forward.

    compiler = GrammarCompiler(tokenizer, vocab_size, eos_ids)   # ~1 s: once per tokenizer
    grammar = compiler.compile(response_format)                  # OpenAI's response_format, or
    grammar = compiler.json_schema(schema) / .lark(text) / .regex(text)
    state = grammar.state()                                      # one per sequence
    tree, allowed = state.constrain(tree, prune=True)            # [n', V] bool, each node's path
    state.commit(tokens)

llguidance is an optional extra (`pip install 'outrider[structured]'`): chosen over xgrammar for
having no dependencies (xgrammar pulls triton and a TVM runtime) at a measured per-token cost
well under a millisecond (docs/serving.md, Structured outputs).

JSON schemas are strict by default (`closed_objects`), as OpenAI's strict mode and xgrammar's
default: an object carries only the properties its schema names, unless the schema sets
`additionalProperties` (or `unevaluatedProperties`) itself. JSON Schema's own default (any other
property allowed) let a small model wander on past the last named property until max_tokens.
`strict=False` (OpenAI's `"strict": false`) keeps the schema as written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ConfigError
from .tree import children
from .types import DraftTree

EXTRA = "pip install 'outrider[structured]'"


def _llguidance():
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise ConfigError(f"structured outputs need llguidance, which is not installed: {EXTRA}") from None
    return llguidance


class GrammarError(RuntimeError):
    """The grammar reached a state that allows no token, or refused a committed one."""


class GrammarCompiler:
    """Grammars for one tokenizer (its llguidance form is built once: about a second)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: set[int] | list[int]):
        ll = _llguidance()
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(eos_ids)
        self.tokenizer = ll.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=sorted(eos_ids))
        self._matcher = ll.LLMatcher

    def json_schema(self, schema: dict | str, strict: bool = True) -> "Grammar":
        """A grammar of `schema`; strict (the default): objects closed where the schema does not
        say what else they may hold (`closed_objects`)."""
        try:
            if isinstance(schema, str):
                schema = json.loads(schema)
            if not isinstance(schema, dict):
                raise ValueError(f"got {type(schema).__name__}")
            text = self._matcher.grammar_from_json_schema(json.dumps(closed_objects(schema) if strict else schema))
        except ValueError as err:
            raise ConfigError(f"the JSON schema is not a JSON object: {err}") from None
        return self._checked(text, "JSON schema")

    def json_object(self) -> "Grammar":
        return self.json_schema({"type": "object"}, strict=False)  # any object

    def lark(self, text: str) -> "Grammar":
        return self._checked(self._matcher.grammar_from_lark(text), "Lark grammar")

    def regex(self, text: str) -> "Grammar":
        return self._checked(self._matcher.grammar_from_regex(text), "regex")

    def compile(self, response_format: dict) -> "Grammar | None":
        """OpenAI's `response_format`: {"type": "text"} (None: no grammar), {"type":
        "json_object"}, or {"type": "json_schema", "json_schema": {"name", "schema", "strict"?}}
        (strict unless "strict" is false)."""
        kind = response_format.get("type") if isinstance(response_format, dict) else None
        if kind == "text":
            return None
        if kind == "json_object":
            return self.json_object()
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if not isinstance(schema, dict):
                raise ConfigError("response_format json_schema needs json_schema.schema: a JSON schema object")
            return self.json_schema(schema, strict=spec.get("strict") is not False)
        raise ConfigError(f"response_format type must be text, json_object or json_schema, got {kind!r}")

    def _checked(self, text: str, what: str) -> "Grammar":
        error = self._matcher.validate_grammar(text, self.tokenizer)
        if error:
            lines = [line.strip() for line in error.splitlines() if line.strip()]
            raise ConfigError(f"the {what} cannot be used: {' '.join(lines)[:300]}")
        return Grammar(text, self)


@dataclass(frozen=True)
class Grammar:
    text: str  # llguidance's grammar
    compiler: GrammarCompiler

    def state(self) -> "GrammarState":
        matcher = self.compiler._matcher(self.compiler.tokenizer, self.text, log_level=0)
        if matcher.is_error():
            raise ConfigError(f"the grammar cannot be used: {matcher.get_error()}")
        return GrammarState(matcher, self.compiler.vocab_size, self.compiler.eos_ids)


class GrammarState:
    """One sequence's grammar state: after its committed output tokens. The matcher is never
    handed a token its mask forbids (that would put it in an error state for good); an
    end-of-sequence token, allowed where the grammar is complete, ends the sequence and is not
    consumed."""

    def __init__(self, matcher, vocab: int, eos_ids: frozenset[int] = frozenset()):
        self.matcher = matcher
        self.vocab = vocab
        self.eos_ids = eos_ids

    def _mask(self) -> np.ndarray:
        """The tokens allowed now: bool [vocab]."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab].astype(bool)
        if not allowed.any():
            raise GrammarError(f"the grammar allows no token here ({self.matcher.get_error() or 'a dead end'})")
        return allowed

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next (the only continuation it allows)."""
        return self.matcher.compute_ff_tokens()[:limit] if limit > 0 else []

    def constrain(self, tree: DraftTree, prune: bool) -> tuple[DraftTree, torch.Tensor]:
        """The tree (pruned at forbidden tokens when `prune`) and each remaining node's allowed
        tokens, bool [n', V]: the grammar's state after the committed tokens and the node's path.
        A forbidden node left in (prune False) and its subtree allow every token: they are
        rejected at that node's parent, so their rows never choose a token."""
        tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
        kids = children(parents)
        allowed: dict[int, np.ndarray] = {}
        keep = [0]

        def visit(node: int) -> None:
            allowed[node] = self._mask()
            for child in kids[node]:
                token = tokens[child]
                if allowed[node][token] and token in self.eos_ids:
                    keep.extend(_subtree(kids, child))  # the end: nothing below it is ever committed
                elif allowed[node][token]:
                    if not self.matcher.consume_token(token):
                        raise GrammarError(f"the grammar refused a token its mask allowed: {self.matcher.get_error()}")
                    keep.append(child)
                    visit(child)
                    self.matcher.rollback(1)
                elif not prune:
                    keep.extend(_subtree(kids, child))

        visit(0)
        keep.sort()
        free = np.ones(self.vocab, dtype=bool)
        masks = torch.from_numpy(np.stack([allowed.get(node, free) for node in keep]))  # [n', V]
        if len(keep) == len(tokens):
            return tree, masks
        index = {old: new for new, old in enumerate(keep)}
        new_parents = [-1] + [index[parents[node]] for node in keep[1:]]
        probs = tree.draft_probs[keep] if tree.draft_probs is not None else None
        return DraftTree(tree.tokens[keep], torch.tensor(new_parents), probs), masks

    def commit(self, tokens: list[int]) -> None:
        for token in tokens:
            if token in self.eos_ids and self.matcher.is_accepting():
                return  # the sequence ends here
            if not self.matcher.consume_token(token):
                raise GrammarError(f"the grammar refused a committed token: {self.matcher.get_error()}")


# Type names function catalogs use that JSON Schema does not (BFCL writes "dict", "float", "tuple")
_TYPE_NAMES = {"dict": "object", "float": "number", "tuple": "array", "any": None}


def parameters_schema(schema) -> dict:
    """A function's `parameters` as a JSON schema: foreign type names mapped (`_TYPE_NAMES`;
    "any" drops the constraint), nested properties, items and alternatives walked."""
    if not isinstance(schema, dict):
        return {}
    out = {}
    for key, value in schema.items():
        if key == "type":
            names = value if isinstance(value, list) else [value]
            mapped = [_TYPE_NAMES.get(n, n) if isinstance(n, str) else n for n in names]
            if None in mapped:
                continue
            out[key] = mapped if isinstance(value, list) else mapped[0]
        elif key == "properties" and isinstance(value, dict):
            out[key] = {name: parameters_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            out[key] = parameters_schema(value)
        elif key in ("anyOf", "oneOf", "allOf") and isinstance(value, list):
            out[key] = [parameters_schema(sub) for sub in value]
        else:
            out[key] = value
    return out


def tool_call_schema(functions: list[dict], name: str | None = None) -> dict:
    """One call of one of `functions` (OpenAI function objects: name, description, parameters,
    strict), or of the one named `name`, as a JSON schema: {"name": its name, "arguments": its
    parameters}, the arguments strict (`closed_objects`) unless the function says "strict": false.
    The schema is final: compile it with json_schema(schema, strict=False)."""
    chosen = [f for f in functions if name is None or f.get("name") == name]
    if not chosen:
        raise ConfigError(f"no function named {name!r} among the tools: " +
                          ", ".join(str(f.get("name")) for f in functions))
    calls = []
    for f in chosen:
        arguments = parameters_schema(f.get("parameters") or {"type": "object"})  # none: no arguments ({})
        calls.append({"type": "object", "properties": {
            "name": {"const": f["name"]},
            "arguments": closed_objects(arguments) if f.get("strict") is not False else arguments},
            "required": ["name", "arguments"], "additionalProperties": False})
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


# keywords whose value is a subschema, a list of them, or a map of names to them: those that give
# an instance's parts their own schema (closed), and those that add to or test the schema beside
# them (their objects left open: closing them would forbid what the schema beside them names)
_PARTS = ("items", "additionalItems", "unevaluatedItems", "contains", "additionalProperties",
          "unevaluatedProperties", "propertyNames")
_BESIDE = ("not", "if", "then", "else")
_UNIONS = ("anyOf", "oneOf")
_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties")  # the schema says what else an object holds
_ADDING = ("allOf", "anyOf", "oneOf", "then", "else", "dependentSchemas", "$ref")  # may name more properties


def closed_objects(schema):
    """`schema` made strict (a copy): every object schema (type "object", or one that lists
    properties) that does not set additionalProperties or unevaluatedProperties itself gets
    additionalProperties false, so an object holds only the properties its schema names (those
    in `required` count as named: {} where `properties` lacks them) and the patterns it lists.
    Left as written: an object whose properties other schemas beside its own keywords may add to
    (allOf, anyOf, oneOf, then / else, dependentSchemas, $ref), and those schemas, and the ones
    that test it (not, if). Subschemas are walked whatever their place."""
    return _closed(schema, close=True)


def _is_object(schema: dict) -> bool:
    kind = schema.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind) or \
        (kind is None and ("properties" in schema or "patternProperties" in schema))


def _closed(schema, close: bool):
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    obj = _is_object(schema)
    for key in (*_PARTS, *_BESIDE):
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key], close=key in _PARTS)
    for key in ("prefixItems", "items", *_UNIONS):  # items: its old list form
        if isinstance(out.get(key), list):
            members_close = key not in _UNIONS or (close and not obj)
            out[key] = [_closed(sub, close=members_close) for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_closed(sub, close=False) for sub in out["allOf"]]
    for key in (*_MAPS, "dependentSchemas"):
        if isinstance(out.get(key), dict):
            out[key] = {name: _closed(sub, close=key in _MAPS) for name, sub in out[key].items()}
    if close and obj and not any(key in schema for key in (*_OPEN_KEYS, *_ADDING)):
        named = out.get("properties") if isinstance(out.get("properties"), dict) else {}
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        missing = [n for n in required if isinstance(n, str) and n not in named]
        if missing:
            out["properties"] = {**named, **{n: {} for n in missing}}
        out["additionalProperties"] = False
    return out


def _subtree(kids: list[list[int]], node: int) -> list[int]:
    out, stack = [], [node]
    while stack:
        n = stack.pop()
        out.append(n)
        stack.extend(kids[n])
    return out


def forced_chain(root: int, forced: list[int], vocab: int, with_probs: bool) -> DraftTree:
    """The chain of forced tokens after `root`; with `with_probs`, each draft's q is the point
    mass on it (what a verifier of drafts drawn from q needs)."""
    probs = None
    if with_probs:
        probs = torch.zeros(len(forced) + 1, vocab)  # [n, V]: row i is the law of node i's child
        probs[torch.arange(len(forced)), torch.tensor(forced)] = 1.0
    return DraftTree.chain(root, forced, probs)
