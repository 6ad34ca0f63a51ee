"""OUTLETS' output-length predictor: a least-squares regression of log output length.

    model = LengthModel.load()                  # the shipped weights (outlets_length.json)
    model.predict(request)                      # expected output tokens, at most request.max_tokens
    LengthModel.fit(records).save(path)         # scripts/train_outlets_length.py does this

A record is one finished request of a bench run (`outrider bench rollout`, bench/rollout.py):
its workload, prompt tokens, output tokens and, where the run recorded them, drafter features
(`features`: the tokens each of the first rounds committed with the suffix drafter). The row a
request becomes:

    [1, log(1 + prompt_tokens), one-hot workload (the training set's names; unknown: all zero),
     has_features, mean of features (0 when absent)]          # shape [5 + len(workloads) - 1 ...]

and the target is log(1 + output_tokens); ridge regularised normal equations (a handful of
weights, no iterations). The prediction is exp(row . w) - 1, the median of the fitted
log-normal, capped at max_tokens. Weights are JSON, never pickle.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError
from .policy import RequestInfo

FEATURE_ROUNDS = 4  # the rounds whose committed tokens are a request's drafter features (bench/rollout.py records them)

DEFAULT_PATH = Path(__file__).with_name("outlets_length.json")


@dataclass(frozen=True)
class LengthModel:
    workloads: tuple[str, ...]
    weights: tuple[float, ...]  # [3 + len(workloads) + 1]: bias, log prompt, workloads..., has_features, features
    residual: float = 0.0  # RMS error in log space on the training set
    meta: dict = field(default_factory=dict)

    @staticmethod
    def row(workloads: tuple[str, ...], prompt_tokens: int, workload: str | None, features) -> list[float]:
        feats = [float(f) for f in features]
        return ([1.0, math.log1p(max(prompt_tokens, 0))] + [1.0 if workload == w else 0.0 for w in workloads]
                + [1.0 if feats else 0.0, sum(feats) / len(feats) if feats else 0.0])

    def log_length(self, request: RequestInfo) -> float:
        x = self.row(self.workloads, request.prompt_tokens, request.workload, request.features)
        return sum(a * b for a, b in zip(x, self.weights))

    def predict(self, request: RequestInfo) -> float:
        """Expected output tokens (the fitted median), between 1 and request.max_tokens."""
        return min(max(math.expm1(self.log_length(request)), 1.0), float(max(request.max_tokens, 1)))

    @staticmethod
    def fit(records: list[dict], ridge: float = 1e-3, meta: dict | None = None) -> "LengthModel":
        import torch

        if len(records) < 2:
            raise ConfigError(f"the length model needs at least 2 records to fit, got {len(records)}")
        workloads = tuple(sorted({str(r["workload"]) for r in records if r.get("workload") is not None}))
        x = torch.tensor([LengthModel.row(workloads, r["prompt_tokens"], r.get("workload"), r.get("features", ()))
                          for r in records], dtype=torch.float64)  # [N, D]
        y = torch.tensor([math.log1p(r["output_tokens"]) for r in records], dtype=torch.float64)  # [N]
        gram = x.T @ x + ridge * torch.eye(x.shape[1], dtype=torch.float64)  # [D, D]
        w = torch.linalg.solve(gram, x.T @ y)  # [D]
        residual = float(((x @ w - y) ** 2).mean().sqrt())
        return LengthModel(workloads, tuple(float(v) for v in w), residual, dict(meta or {}, records=len(records)))

    def to_json(self) -> dict:
        return {"kind": "outlets-length", "workloads": list(self.workloads), "weights": list(self.weights),
                "residual": self.residual, "meta": self.meta}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @staticmethod
    def load(path: str | Path | None = None) -> "LengthModel":
        """The model in `path` (default: the shipped one); one-line ConfigError when it is not one."""
        path = Path(path or DEFAULT_PATH)
        try:
            raw = json.loads(path.read_text())
            workloads = tuple(str(w) for w in raw["workloads"])
            weights = tuple(float(v) for v in raw["weights"])
        except OSError as err:
            raise ConfigError(f"length model {path}: cannot read it ({err.strerror or err})") from None
        except (ValueError, KeyError, TypeError):
            raise ConfigError(f"length model {path}: not an OUTLETS length model (workloads, weights)") from None
        if raw.get("kind") != "outlets-length" or len(weights) != 4 + len(workloads):
            raise ConfigError(f"length model {path}: not an OUTLETS length model, or its weights and "
                              "workloads disagree in number")
        return LengthModel(workloads, weights, float(raw.get("residual", 0.0)), dict(raw.get("meta", {})))
