"""Drafters by name: the built-ins, and plugins from the ``nodraft.drafters`` entry points.

A drafter class carries a ``Params`` dataclass (its request parameters, with defaults and
checks in ``__post_init__``) and is built per request as ``cls(params, env)``. ``env``
gives it the target and a ``shared`` dict that lives as long as the server (per drafter
and model), for state shared across requests such as suffix decoding's global tree.
Registering a drafter touches no other drafter and no if/elif chain.
"""

from __future__ import annotations

import dataclasses
from importlib import import_module
from importlib.metadata import entry_points
from typing import Any, get_type_hints

from nodraft.drafters.base import DrafterEnv, SpeculationError, hook  # noqa: F401 (the registry's API)

BUILTIN = {
    "none": "nodraft.drafters.none:NoDraft",
    "prompt_lookup": "nodraft.drafters.prompt_lookup:PromptLookup",
    "early_exit": "nodraft.drafters.early_exit:EarlyExit",
    "suffix": "nodraft.drafters.suffix:SuffixDecoding",
    "lookahead": "nodraft.drafters.lookahead:Lookahead",
    "medusa": "nodraft.drafters.medusa:Medusa",
    "eagle": "nodraft.drafters.eagle:Eagle",
    "auto": "nodraft.drafters.auto:Auto",
}
ALIASES = {"ngram": "prompt_lookup"}


def _load(target: str) -> type:
    module, _, attr = target.partition(":")
    return getattr(import_module(module), attr)


class Registry:
    def __init__(self, builtin: dict[str, str] | None = None, plugins: bool = True):
        self._targets = dict(BUILTIN if builtin is None else builtin)
        self._classes: dict[str, type] = {}
        self._hints: dict[str, dict[str, type]] = {}  # per method: its Params' field types
        if plugins:
            for ep in entry_points(group="nodraft.drafters"):
                self._targets.setdefault(ep.name, ep.value)

    def register(self, name: str, cls_or_target: type | str) -> None:
        self._hints.pop(name, None)
        if isinstance(cls_or_target, str):
            self._classes.pop(name, None)  # loaded from the new target when first used
            self._targets[name] = cls_or_target
        else:
            self._classes[name] = cls_or_target
            self._targets[name] = f"{cls_or_target.__module__}:{cls_or_target.__qualname__}"

    def targets(self) -> dict[str, str]:
        """Every method's ``module:attribute`` (plugins and registered classes included):
        ``Registry(builtin=targets, plugins=False)`` rebuilds this registry elsewhere, as
        the engine process does."""
        return dict(self._targets)

    def names(self) -> list[str]:
        return sorted(self._targets)

    def canonical(self, method: str) -> str:
        method = ALIASES.get(method, method)
        if method not in self._targets:
            raise SpeculationError(
                f"unknown speculation method {method!r}; available: "
                + ", ".join(self.names() + [f"{a} (= {t})" for a, t in ALIASES.items()]),
                "speculation.method")
        return method

    def drafter_class(self, method: str) -> type:
        method = self.canonical(method)
        if method not in self._classes:
            self._classes[method] = _load(self._targets[method])
        return self._classes[method]

    def parse(self, speculation: str | dict | None, default: str | dict = "none") -> tuple[str, Any]:
        """``"method"`` or ``{"method": ..., **params}`` -> (canonical method, Params)."""
        spec = default if speculation is None else speculation
        if isinstance(spec, str):
            spec = {"method": spec}
        if not isinstance(spec, dict) or not isinstance(spec.get("method"), str):
            raise SpeculationError(
                "speculation must be a method name or an object with a string 'method'")
        params = {k: v for k, v in spec.items() if k != "method"}
        method = self.canonical(spec["method"])
        cls = self.drafter_class(method)
        known = {f.name: f for f in dataclasses.fields(cls.Params)}
        unknown = sorted(set(params) - set(known))
        if unknown:
            raise SpeculationError(
                f"unknown parameter(s) {unknown} for speculation method {method!r}; "
                f"it takes: {sorted(known) or 'no parameters'}", f"speculation.{unknown[0]}")
        hints = self._hints.get(method)
        if hints is None:  # evaluating the annotations costs more than the rest of a parse
            hints = self._hints[method] = get_type_hints(cls.Params)
        for k, v in params.items():
            want = hints[k]
            ok = isinstance(v, want) and not (isinstance(v, bool) and want is not bool)
            if want is float and isinstance(v, int) and not isinstance(v, bool):
                ok, params[k] = True, float(v)
            if not ok:
                raise SpeculationError(f"speculation.{k} must be {want.__name__}, got {v!r}",
                                       f"speculation.{k}")
        try:
            return method, cls.Params(**params)
        except (TypeError, ValueError) as e:
            raise SpeculationError(f"speculation for {method!r}: {e}") from None

    def check(self, method: str, params: Any, env: DrafterEnv) -> None:
        """Cheap checks a drafter can make before it is built (``cls.check(params, env)``,
        optional): trained weights present, parameters within what was trained. Raises
        SpeculationError, which the API turns into a 400 before the request is queued. The
        API process holds no weights: ``env.model`` is None here, ``env.model_name`` and
        ``env.checkpoint_dir`` say where to look."""
        check = hook(self.drafter_class(method), "check")
        if check is not None:
            check(params, env)

    def build(self, method: str, params: Any, env: DrafterEnv):
        return self.drafter_class(method)(params, env)

    def describe(self) -> dict[str, dict]:
        """Every method with its parameters and defaults (for errors, docs and /v1/models)."""
        out = {}
        for name in self.names():
            try:
                cls = self.drafter_class(name)
            except Exception as e:  # a broken plugin must not take the server down
                out[name] = {"error": f"{type(e).__name__}: {e}"}
                continue
            out[name] = {f.name: f.default for f in dataclasses.fields(cls.Params)}
        return out
