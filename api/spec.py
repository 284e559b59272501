"""The sweep spec: what a user submits (HTTP body, YAML/TOML file, dashboard form, schedule template).

One pydantic model validates every entry point the same way; ``to_problem()`` is the tuner's
Problem it describes (built once, when the spec is validated), their ``SpecError`` re-raised as a
validation error that names the field.
"""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from tuner import (
    ClusterSpec,
    Layout,
    ModelSpec,
    Problem,
    SearchSpace,
    SpecError,
    TrainingSpec,
    canonical_layout,
    check_layout,
    check_planning_work,
    check_supported,
    cluster_spec,
    model_spec,
    training_spec,
    twin_note,
    within_capabilities,
)
from workers import DIAGNOSTIC_OPTIONS

SAMPLERS = ("surrogate", "tpe", "nsga2", "gp", "random", "grid")
# Sanity bounds far above any real job. 2^18 devices is above the largest accelerator clusters built
# (~10^5); the search enumerates divisors of both numbers.
MAX_DEVICES = 2**18
MAX_GLOBAL_BATCH = 2**31
# Optuna's TPE and GP samplers refit on every past trial at each proposal, so a sweep's coordinator
# time grows with the square of its trials: 10^4 is far beyond what a layout space needs.
MAX_TRIALS = 10_000
# Candidate layouts (tuner._plan.candidate_layouts) a sweep may enumerate at submission and in the
# engine: ~1 s of enumeration on one core; 2^18 devices have ~5 x 10^5.
MAX_CANDIDATES = 4_000_000
_BACKEND = re.compile(r"^(ray|simulate|[A-Za-z_][\w.]*:[A-Za-z_][\w.]*)$")
_WORKLOAD = re.compile(r"^(builtin|hf|[A-Za-z_][\w.]*:[A-Za-z_][\w.]*)$")


def text_problem(value: str) -> str | None:
    """Why ``value`` cannot be stored as text, or None. PostgreSQL's text and jsonb types refuse the
    NUL character (https://www.postgresql.org/docs/current/datatype-character.html), and neither
    store can encode a lone UTF-16 surrogate (which JSON's \\ud800 escapes can produce) as UTF-8."""
    if "\x00" in value:
        return "contains a NUL character (\\u0000), which text cannot hold"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"contains a lone surrogate ({value[exc.start]!r}), which is not valid Unicode text"
    return None


def find_unstorable(data: Any) -> tuple[list[str | int], Any, str] | None:
    """(path, value, reason) of the first value at any depth that a store cannot hold, or None: a
    string (a mapping key or a value) that ``text_problem`` refuses, or a float that is not finite
    (Python's JSON reader takes ``Infinity``, ``NaN`` and ``1e999``, which RFC 8259 section 6 does
    not allow; PostgreSQL's json type refuses them). Iterative: deep data cannot exhaust the stack."""
    stack: list[tuple[list[str | int], Any]] = [([], data)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            if (why := text_problem(item)) is not None:
                return path, item, why
        elif isinstance(item, float):
            if not math.isfinite(item):
                return path, item, f"is {item}, not a finite number (JSON has no Infinity or NaN)"
        elif isinstance(item, dict):
            for key, sub in reversed(list(item.items())):
                if isinstance(key, str) and (why := text_problem(key)) is not None:
                    return path, key, f"has a key that {why}"
                stack.append(([*path, key], sub))
        elif isinstance(item, (list, tuple)):
            stack.extend(([*path, i], sub) for i, sub in reversed(list(enumerate(item))))
    return None


class RequestModel(BaseModel):
    """What every request body (HTTP, dashboard form, CLI file) is validated by.

    * strict types: a boolean must be a JSON boolean and a number must not be one (lax mode would
      take ``"min_effect": false`` as 0.0 and ``"cpu_bf16": 0`` as False); ints stay valid floats;
    * no unknown fields;
    * no value the stores cannot hold (``find_unstorable``: NUL, lone surrogates, Infinity/NaN),
      anywhere in the body, free-form mappings included: a 422 naming the field (``type``
      ``value_unstorable``, ``ctx.path`` its location in the body) instead of a database error (a
      500) at the INSERT."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _storable_text(cls, data: Any) -> Any:
        bad = find_unstorable(data)
        if bad is not None:
            path, _, why = bad
            field = ".".join(str(p) for p in path) or "body"
            raise PydanticCustomError("value_unstorable", "{field} {why}", {"field": field, "why": why, "path": path})
        return data


class ConfirmSettings(RequestModel):
    """``search.confirm``: once the search and its re-measurements end, run the top layouts longer."""

    top_k: int = Field(5, ge=1, le=1000, description="How many of the ranking's leading layouts run again (in a "
                       "spec: fewer when fewer are ranked; asked of a completed sweep: at most its ranked layouts).")
    steps: int | None = Field(None, ge=1, le=10_000, description="Measured steps of each long run (default: "
                              "10 x trial.measure_steps).")


MAX_LEARN_FROM = 20  # sweeps a new sweep may name in search.learn_from


class SearchSettings(RequestModel):
    sampler: Literal["surrogate", "tpe", "nsga2", "gp", "random", "grid"] = Field(
        "surrogate", description="How layouts are proposed: surrogate (default: the analytical model's parts "
        "reweighted by the measurements plus a GP on what they leave, constrained expected improvement; "
        "api/engine/_surrogate.py), Optuna's tpe, gp or nsga2 (maximises tokens/s and minimises peak memory), "
        "random or grid."
    )
    max_trials: int = Field(
        20, ge=1, json_schema_extra={"maximum": MAX_TRIALS},
        description=f"Trials to run (pruned-by-model ones included); at most {MAX_TRIALS:,} (the sampler's cost "
        "per proposal grows with the trials before it).",
    )
    max_device_seconds: float | None = Field(
        None, gt=0, description="Stop once the trials have held devices this long in total."
    )
    patience: int | None = Field(None, ge=1, description="Stop after this many trials without improvement.")
    warm_start_top_k: int = Field(3, ge=0, description="Enqueue the analytical model's top-k layouts first.")
    reference_layouts: list[str] = Field(
        default_factory=list, description="Names of reference layouts (tuner.REFERENCE_LAYOUTS) to enqueue."
    )
    repeats: int = Field(3, ge=1, le=50, description="Measurements of each top-k layout for the ranking interval.")
    remeasure_top_k: int = Field(3, ge=0, description="How many leading layouts are re-measured `repeats` times.")
    seed: int = Field(0, ge=0, le=2**32 - 1, description="Sampler seed (numpy's seed range: 0 .. 2^32 - 1).")
    layouts: list[dict[str, Any]] | None = Field(
        None,
        max_length=1000,
        description="Measure exactly these layouts (Layout mappings; dp may be left out and is then derived "
        "from the device count), in this order, each `repeats` times; no sampler and no warm start (the memory "
        "model still prunes a layout it predicts cannot fit). Ignores max_trials, patience and remeasure_top_k; "
        "cannot be combined with `space` or `reference_layouts`.",
    )
    confirm: ConfirmSettings | None = Field(
        None, description="Confirm the winner: after the search, run the top_k ranked layouts for `steps` "
        "measured steps each, as their own phase (not in the ranking), and report the short-run order "
        "against the long-run order (`meshtune confirm` asks the same of a completed sweep).",
    )

    learn_from: Literal["auto", "none"] | list[int] = Field(
        "auto", description="What the sweep starts from: auto (default: what the newest earlier sweeps on the same "
        "cluster fingerprint learned: calibration, memory model, residuals), none (a cold sweep, nothing "
        "inherited), or a list of sweep ids of the same cluster (learn from those only). What is inherited is "
        "weighed by the measurements behind it and dropped, said in the calibration's notes, when the sweep's own "
        f"first measurements contradict it. At most {MAX_LEARN_FROM} ids.",
    )

    @field_validator("learn_from", mode="before")
    @classmethod
    def _learn_from(cls, value: Any) -> Any:
        if isinstance(value, str) and value not in ("auto", "none"):
            raise ValueError(f"search.learn_from={value!r} is not auto, none or a list of sweep ids")
        if isinstance(value, list):
            if not value:
                raise ValueError("search.learn_from=[] names no sweep: give sweep ids, or none for a cold sweep")
            if len(value) > MAX_LEARN_FROM:
                raise ValueError(f"search.learn_from lists {len(value)} sweeps; at most {MAX_LEARN_FROM}")
            for i, v in enumerate(value):
                if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 2**31 - 1:
                    raise ValueError(f"search.learn_from[{i}]={v!r} is not a sweep id")
            if len(set(value)) != len(value):
                raise ValueError(f"search.learn_from={value!r} names a sweep twice")
        return value

    @field_validator("max_trials")
    @classmethod
    def _max_trials(cls, value: int) -> int:
        if value > MAX_TRIALS:
            raise ValueError(f"search.max_trials={value} exceeds the limit of {MAX_TRIALS:,} trials per sweep "
                             "(each proposal's cost grows with the trials before it)")
        return value


class TrialOptions(RequestModel):
    """Worker options, typed. Some are DIAGNOSTIC (``fail``, ``sleep_per_step_s``,
    ``memory_cap_bytes``): they inject failures, slowness or a smaller device, so a sweep that uses
    them is flagged ``diagnostic`` and its numbers are never real measurements of the layout. With the
    built-in backends (ray, simulate) any other key is refused; a plug-in backend (``module:attr``)
    defines its own options, which pass through unchecked."""

    model_config = ConfigDict(extra="allow")  # strict types and storable text from RequestModel

    fail: Literal["crash", "hang", "oom", "nan"] | None = Field(
        None, description="DIAGNOSTIC: inject this failure on fail_rank at fail_step.")
    fail_rank: int | None = Field(None, ge=0, description="Rank that fails (default 0).")
    fail_step: int | None = Field(None, ge=0, description="Step at which it fails (default 1).")
    sleep_per_step_s: float | None = Field(None, ge=0, description="DIAGNOSTIC: sleep this long in every step.")
    min_step_s: float | None = Field(None, ge=0, description="DIAGNOSTIC: every step lasts at least this long.")
    memory_cap_bytes: int | None = Field(None, gt=0, description="DIAGNOSTIC: cap each rank's device memory.")
    grad_norm: bool | None = Field(None, description="Record the gradient norm of every step.")
    cpu_bf16: bool | None = Field(None, description="Run bf16 on CPU ranks too (default: fp32 on CPU).")
    init_timeout_s: float | None = Field(None, gt=0, description="Timeout for the process group's start-up.")

    @property
    def diagnostic(self) -> bool:
        return any(getattr(self, k) is not None for k in DIAGNOSTIC_OPTIONS)

    def to_worker(self) -> dict[str, Any]:
        """The options as the workers read them (unset ones left out)."""
        return self.model_dump(exclude_none=True)


class TrialSettings(RequestModel):
    warmup_steps: int = Field(2, ge=0, le=1000, description="Steps run and discarded before timing.")
    measure_steps: int = Field(3, ge=1, le=10_000, description="Timed steps.")
    step_timeout_s: float = Field(120.0, gt=0, description="Per-step watchdog; a slower step ends the trial as timeout.")
    options: TrialOptions = Field(default_factory=TrialOptions, description="Worker options (see TrialOptions).")

    @field_serializer("options")
    def _dump_options(self, options: TrialOptions) -> dict[str, Any]:
        return options.to_worker()


class SweepSpec(RequestModel):
    """A sweep: which model on which cluster with which batch, and how to search its layouts."""

    model_config = ConfigDict(
        frozen=True,  # to_problem() is built once, at validation: no field changes after it
        json_schema_extra={
            "examples": [
                {
                    "name": "tiny-cpu",
                    "model": "tiny",
                    "cluster": "cpu-local",
                    "training": {"global_batch": 16, "precision": "fp32"},
                    "search": {"sampler": "tpe", "max_trials": 8},
                    "trial": {"warmup_steps": 1, "measure_steps": 3},
                    "backend": "ray",
                },
                {
                    "name": "llama3-70b-on-64-h100",
                    "model": "llama3-70b",
                    "cluster": {"preset": "h100-sxm", "nodes": 8},
                    "training": {"global_batch_tokens": 4194304, "critical_batch_tokens": 16777216},
                    "search": {"sampler": "nsga2", "max_trials": 40},
                    "backend": "simulate",
                },
            ]
        },
    )

    name: str = Field("sweep", min_length=1, max_length=200, description="A human-readable label.")
    model: str | dict[str, Any] = Field(description="Model preset name, or a mapping (optional 'preset' + overrides), "
                                        "or {'hf_config': {...config.json object...}, 'seq_len'?, 'name'?} (a path is "
                                        "refused: the server reads no files).")
    cluster: str | dict[str, Any] = Field(description="Cluster preset name, or a mapping (optional 'preset' + overrides).")
    training: dict[str, Any] = Field(
        description="global_batch (sequences) or global_batch_tokens; critical_batch(_tokens), precision, lr, seed."
    )
    space: dict[str, Any] = Field(
        default_factory=dict, description="Restrictions of the layout search space (tuner.SearchSpace fields)."
    )
    search: SearchSettings = Field(
        default_factory=SearchSettings, description="How layouts are searched: sampler, budgets, warm start, repeats."
    )
    trial: TrialSettings = Field(
        default_factory=TrialSettings, description="How each trial is run: warm-up and measured steps, watchdog."
    )
    backend: str = Field("ray", description="Trial backend: 'ray', 'simulate', or an importable 'module:attr'.")
    workload: str = Field(
        "builtin", description="The model code trials train: 'builtin' (meshtune's decoder), 'hf' (the transformers "
        "implementation of model.hf_config) or an importable 'module:attr' Workload (workers/workload.py); layouts "
        "it does not declare support for are refused.")
    _problem: Problem | None = PrivateAttr(None)  # to_problem(), built once

    @field_validator("workload")
    @classmethod
    def _check_workload(cls, value: str) -> str:
        if not _WORKLOAD.match(value):
            raise ValueError(f"workload={value!r} is not 'builtin', 'hf' nor an importable 'module:attr' path")
        return value

    @field_validator("backend")
    @classmethod
    def _check_backend(cls, value: str) -> str:
        if not _BACKEND.match(value):
            raise ValueError(f"backend={value!r} is not 'ray', 'simulate' nor an importable 'module:attr' path")
        return value

    @model_validator(mode="after")
    def _check_problem(self) -> SweepSpec:
        model, cluster, training = self._specs()  # raises ValueError (SpecError) naming the field and value
        if training.stack != "meshtune":
            raise SpecError(f"training.stack={training.stack!r}: a sweep measures meshtune's own workers (stack "
                            "meshtune); predict another stack with `meshtune plan --stack`, `meshtune show SWEEP "
                            "--stack` or `meshtune export`")
        problem = self.to_problem()  # imports and checks a workload's contract (WorkloadError naming it)
        if cluster.devices > MAX_DEVICES:
            raise SpecError(
                f"cluster.nodes={cluster.nodes} x cluster.devices_per_node={cluster.devices_per_node} "
                f"= {cluster.devices} devices exceeds the limit of {MAX_DEVICES}"
            )
        if training.global_batch > MAX_GLOBAL_BATCH:
            raise SpecError(
                f"training.global_batch={training.global_batch} sequences exceeds the limit of {MAX_GLOBAL_BATCH}"
            )
        if self.listed_layouts() is None:  # the sweep enumerates its space: bound that work first
            check_planning_work(model=model, cluster=cluster, space=problem.space, limit=MAX_CANDIDATES,
                                where="sweep", training=problem.training)
        extra = sorted(self.trial.options.model_extra or {})
        if extra and self.backend in ("ray", "simulate"):
            known = ", ".join(sorted(TrialOptions.model_fields))
            raise SpecError(f"trial.options.{extra[0]} is not a worker option of backend {self.backend!r} "
                            f"(known: {known})")
        return self

    @property
    def diagnostic(self) -> bool:
        """The trials inject failures, slowness or a memory cap: not real measurements of the layouts."""
        return self.trial.options.diagnostic

    @property
    def sampler_label(self) -> str:
        """What the sweeps table records as the sampler ("layouts" when search.layouts is given)."""
        return "layouts" if self.search.layouts is not None else self.search.sampler

    def listed_layouts(self) -> list[Layout] | None:
        """The layouts of ``search.layouts`` checked against this problem (SpecError naming
        ``search.layouts[i].<field>``), None when the sweep searches instead."""
        if self.search.layouts is None:
            return None
        if not self.search.layouts:
            raise SpecError("search.layouts is empty: list at least one layout, or leave it out to search")
        if self.space:
            raise SpecError("search.layouts cannot be combined with space: the listed layouts are measured as given")
        if self.search.reference_layouts:
            raise SpecError("search.layouts cannot be combined with search.reference_layouts: list those layouts too")
        problem = self.to_problem()
        model, cluster, training = problem.model, problem.cluster, problem.training
        out: list[Layout] = []
        seen: dict[str, tuple[int, str | None]] = {}  # canonical key -> (index, twin note)
        for i, data in enumerate(self.search.layouts):
            where = f"search.layouts[{i}]"
            if not isinstance(data, dict):
                raise SpecError(f"{where} must be a mapping of layout fields, got {data!r}")
            data, given = dict(data), set(data)
            if "dp" not in data:  # derived from the device count, like the search does
                other = 1
                for axis in ("tp", "pp", "cp", "ep"):
                    value = data.get(axis, 1)
                    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                        other *= value
                if cluster.devices % other == 0:
                    data["dp"] = cluster.devices // other
            try:
                layout = layout_from_mapping(data)
                check_layout(layout, model=model, cluster=cluster, training=training)
                check_supported(layout, model, problem.capabilities)  # valid means runnable
            except (SpecError, TypeError) as exc:
                raise SpecError(_layout_error(where, str(exc), given)) from None
            # Measured and ranked under its canonical key: a twin of a listed layout is that layout.
            canon = canonical_layout(layout, training=training)
            note = twin_note(layout, canon)
            if canon.key in seen:
                j, other = seen[canon.key]
                why = note or other
                raise SpecError(f"{where}={layout.key!r} repeats search.layouts[{j}]"
                                + (f" (the same program: {why})" if why else ""))
            seen[canon.key] = (i, note)
            out.append(canon)
        return out

    def to_problem(self) -> Problem:
        """The tuner's Problem of this sweep, built once: ``space`` as a SearchSpace (SpecError naming
        ``space.<field>``) narrowed to what the workload declares it can realise, and that workload's
        capabilities, checked against its contract (None for the built-in model, which realises every
        layout; torch is imported only for another workload)."""
        if self._problem is None:
            model, cluster, training = self._specs()
            caps = None
            space = SearchSpace.from_mapping(self.space)
            if self.workload != "builtin":
                from workers.workload_registry import check_workload

                caps = check_workload(self.workload, model, training)
                space = within_capabilities(space, caps)
            self._problem = Problem(model=model, cluster=cluster, training=training, space=space,
                                    capabilities=caps)
        return self._problem

    def _specs(self) -> tuple[ModelSpec, ClusterSpec, TrainingSpec]:
        model = model_spec(self.model, allow_path=False)  # hf_config: the config object, never a path
        return model, cluster_spec(self.cluster), training_spec(self.training, seq_len=model.seq_len)


_LAYOUT_FIELD = re.compile(r"\b(tp|pp|dp|cp|ep|zero|mbs|ac|sp|schedule|vpp)\b")


def _layout_error(where: str, message: str, given: set[str]) -> str:
    """``where.<field>: message``, naming the field the message starts with, else the first layout
    field it mentions (one the user gave, if any)."""
    message = message.removeprefix("layout.")
    if message.startswith("tp*cp*ep*dp*pp="):  # the product: the one degree given, else the layout
        degrees = sorted(given & {"tp", "cp", "ep", "dp", "pp"})
        return f"{where}.{degrees[0]}: {message}" if len(degrees) == 1 else f"{where}: {message}"
    first = re.match(r"\w+", message)
    if first and (first.group(0) in given or _LAYOUT_FIELD.fullmatch(first.group(0))):
        return f"{where}.{first.group(0)}: {message}"
    mentioned = _LAYOUT_FIELD.findall(message)
    field = next((f for f in mentioned if f in given), mentioned[0] if mentioned else None)
    return f"{where}.{field}: {message}" if field else f"{where}: {message}"


def layout_from_mapping(data: dict[str, Any]) -> Layout:
    """A Layout from user data, unknown keys named in the error."""
    known = set(Layout.__dataclass_fields__)
    unknown = sorted(set(data) - known)
    if unknown:
        raise SpecError(f"layout.{unknown[0]} is not a known field (known: {', '.join(sorted(known))})")
    return Layout(**data)


class PlanRequest(RequestModel):
    """``POST /api/plan``: the analytical plan of a model given as a mapping, e.g. a Hugging Face
    config object (``{"hf_config": {...}, "seq_len": 4096}``), which a query string cannot carry."""

    model: str | dict[str, Any] = Field(description="Model preset name, mapping (optional 'preset' + overrides), "
                                        "or {'hf_config': {...config.json object...}, 'seq_len'?, 'name'?} "
                                        "(a path is refused: the server reads no files).")
    cluster: str | dict[str, Any] = Field(description="Cluster preset name, or a mapping (optional 'preset' + overrides).")
    training: dict[str, Any] = Field(
        description="global_batch (sequences) or global_batch_tokens; critical_batch(_tokens), precision, ...")
    top: int = Field(10, ge=1, le=200, description="How many of the fastest layouts to return.")

    def to_problem(self) -> Problem:
        model = model_spec(self.model, allow_path=False)
        return Problem(model=model, cluster=cluster_spec(self.cluster),
                       training=training_spec(self.training, seq_len=model.seq_len))


class PlanDevicesRequest(RequestModel):
    """``POST /api/plan/devices``: device types side by side. ``cluster.preset`` is a list of presets
    (the section's other fields apply to each) and ``cluster.price_per_device_hour`` a price per type
    (or one for all); a list that mixes a preset with an inline cluster mapping is refused."""

    model: str | dict[str, Any] = Field(description="Model preset name, mapping, or {'hf_config': {...}} (never a path).")
    cluster: str | list[Any] | dict[str, Any] = Field(
        description="Device types: a list of cluster presets, or {'preset': [...], 'price_per_device_hour': "
        "{type: price}, ...overrides of every type}.")
    training: dict[str, Any] = Field(description="global_batch or global_batch_tokens, train_tokens, stack, ...")
    nodes: list[int] | None = Field(None, max_length=32, description="Node counts to compare (default: each "
                                    "preset's own).")
    scale_batch: bool = Field(False, description="Grow the global batch with the devices from the first size's.")

    def to_comparison(self) -> tuple[ModelSpec, list[ClusterSpec], TrainingSpec]:
        """The model, the device types to compare (one cluster each) and the training: several problems
        that share a model and a training, not one ``tuner.Problem``."""
        from tuner import cluster_types

        model = model_spec(self.model, allow_path=False)
        return model, cluster_types(self.cluster), training_spec(self.training, seq_len=model.seq_len)
