"""The config schema, composed from the stages' own sections, plus profiles and the override grammar.

Override grammar (DESIGN §10): `a.b=value`; a comma makes a grid axis (`depth=1,2,3,4`); brackets keep a list
value whole (`e2e.paper_tree=[8,10,60]`); short keys resolve when unambiguous (`depth` -> `drafter.depth`).
"""
from __future__ import annotations

import difflib
import itertools
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator

# Every section comes from a module that imports no torch or pandas (the train, evaluate and report sections live in
# stages.sections for that reason): `kvshot --help` and `kvshot keys` start without loading them
# (benchmarks/startup.py; tests/test_config.py checks it).
from stages.common import Section, TargetParams
from stages.e2e import E2EParams
from stages.features import FeaturesParams
from stages.prepare import DataParams
from stages.regenerate_backends import RegenerateParams
from stages.sections import DrafterParams, EvalParams, ReportParams, TrainParams

ROOT = Path(__file__).resolve().parent.parent
PROFILES_DIR = ROOT / "profiles"


class ConfigError(ValueError):
    """A one-line, user-facing config problem naming the key or file."""


PART_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


class StudyParams(Section):
    """One study: a grid over config keys (cartesian) plus extra single trials (e.g. the EAGLE-3 baseline)."""

    grid: dict[str, list[Any]] = {}
    include: list[dict[str, Any]] = []
    # an axis over train.seed for every trial of the grid; None: the profile's train.seed (a default of [0] would
    # be written out into a resolved workspace profile and there override a grid's own train.seed axis)
    seeds: list[int] | None = None
    # decode end to end with this study's drafters: all of them (true), or those whose config matches every
    # {key: [values]} of a mapping (e.g. {train.scale: [large]})
    e2e: bool | dict[str, list[Any]] = False
    # named parts, each a filter {KEY: [values]} as `sweep --only` takes (the parents and controls its trials need
    # come along): what `kvshot repro --part STUDY/PART` runs from a fresh workspace, and the unit a study's wall
    # time budget is stated for when the whole study is too long to run in one go; together they cover the plan
    parts: dict[str, dict[str, list[Any]]] = {}
    # evaluate on N conversations carved out of the training pool beyond each trial's data scale instead of the
    # eval split (stages/validation.py): a study that chooses a setting, e.g. a learning rate, on data the verdicts
    # are not measured on; None: the eval split
    validation: int | None = Field(None, ge=1)
    # {KEY: STUDY}: KEY's value taken from a validation study of the profile, per trial: each trial of this study
    # that STUDY trains too (the same settings but KEY, seed and evaluation set) takes the value with the highest
    # validation step MAT there; the others keep the profile's (pipeline/choices.py). STUDY comes first in
    # `studies` (DVC runs them in that order) and this study does not set KEY itself.
    choose: dict[str, str] = {}

    @field_validator("parts")
    @classmethod
    def _part_names(cls, parts: dict[str, dict[str, list[Any]]]) -> dict[str, dict[str, list[Any]]]:
        for name, only in parts.items():
            if not PART_NAME.fullmatch(name):
                raise ValueError(f"part name {name!r}: use letters, digits, '-' and '_' only")
            if not only:
                raise ValueError(f"part {name!r}: an empty filter; give KEY: [values]")
        return parts


class TrackingParams(Section):
    uri: str | None = None                # default sqlite:///mlflow.db in the project; MLFLOW_TRACKING_URI wins
    artifact_root: str = "mlruns"
    experiment_prefix: str = "kvshot"


class RayParams(Section):
    address: str | None = None            # an existing cluster; RAY_ADDRESS wins; None = local in-process Ray
    num_cpus: int | None = Field(None, ge=1)
    cpus_per_trial: float = Field(1.0, gt=0)
    gpus_per_trial: float = Field(0.0, ge=0)
    max_concurrent: int = Field(2, ge=1)


class Config(Section):
    profile: str = "default"
    require_cuda: bool = False            # fail fast on a machine without a GPU (the paper profile)
    target: TargetParams = TargetParams()
    data: DataParams = DataParams()
    regenerate: RegenerateParams = RegenerateParams()
    features: FeaturesParams = FeaturesParams()
    drafter: DrafterParams = DrafterParams()
    train: TrainParams = TrainParams()
    eval: EvalParams = EvalParams()
    e2e: E2EParams = E2EParams()
    report: ReportParams = ReportParams()
    studies: dict[str, StudyParams] = {}
    tracking: TrackingParams = TrackingParams()
    ray: RayParams = RayParams()


# -- keys --------------------------------------------------------------------------------------------------------

def _leaf_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Dotted keys of every overridable leaf; dict-valued sections (sources, scales, studies) stay whole."""
    keys = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            keys += _leaf_keys(ann, f"{prefix}{name}.")
        else:
            keys.append(f"{prefix}{name}")
    return keys


LEAF_KEYS: list[str] = _leaf_keys(Config)


KEYS_HINT = "`kvshot keys` lists all"


def key_values(cfg: "Config") -> list[tuple[str, Any]]:
    """Every overridable key with its value in `cfg` (`kvshot keys`); dict-valued keys hold their whole dict."""
    tree = cfg.model_dump()
    out = []
    for key in LEAF_KEYS:
        node: Any = tree
        for part in key.split("."):
            node = node[part]
        out.append((key, node))
    return out


def close_keys(key: str, candidates: list[str] | None = None, n: int = 3) -> list[str]:
    """The valid keys closest to a mistyped one: by its last part (`dpeth` -> drafter.depth), else as a whole."""
    candidates = LEAF_KEYS if candidates is None else candidates
    by_last: dict[str, list[str]] = {}
    for k in candidates:
        by_last.setdefault(k.rsplit(".", 1)[-1], []).append(k)
    found = [k for last in difflib.get_close_matches(key.rsplit(".", 1)[-1], list(by_last), n, 0.7)
             for k in by_last[last]]
    if not found:   # the whole key (a typo in the section): a shared section alone does not make keys close
        found = difflib.get_close_matches(key, candidates, n, 0.8)
    return list(dict.fromkeys(found))[:n]


def unknown_key_message(key: str, candidates: list[str] | None = None) -> str:
    """`unknown key 'dpeth'; did you mean drafter.depth? (`kvshot keys` lists all)`: never the whole list."""
    near = close_keys(key, candidates)
    guess = f"; did you mean {' or '.join(near)}?" if near else ""
    return f"unknown key {key!r}{guess} ({KEYS_HINT})"


def lookup(cfg: Config | dict, dotted: str) -> Any:
    """The value of a dotted key (`train.seed`) in a resolved config or its dump."""
    node: Any = cfg
    for part in dotted.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def settings_key(cfg: Config, sections: tuple[str, ...], leave_out: Iterable[str] = ()) -> str:
    """The config's `sections` as one comparable string, without the dotted keys `leave_out`: two configs with
    the same agree on everything else there."""
    tree = cfg.model_dump(mode="json")
    part = {s: dict(tree[s]) for s in sections}
    for key in leave_out:
        section, _, name = key.partition(".")
        part.get(section, {}).pop(name, None)
    return json.dumps(part, sort_keys=True, default=str)


def resolve_key(key: str) -> str:
    """Full dotted key for a full or short key; an unknown key is a ConfigError naming the closest valid keys, an
    ambiguous one lists its choices."""
    if key in LEAF_KEYS:
        return key
    matches = [k for k in LEAF_KEYS if k.endswith("." + key)]
    if len(matches) == 1:
        return matches[0]
    if len(matches) > 1:
        raise ConfigError(f"ambiguous key {key!r}: could be {', '.join(matches)}")
    # a dict-valued leaf addressed inside (data.scales.small=100, data.sources.sharegpt.kind=local)
    for k in LEAF_KEYS:
        if key.startswith(k + "."):
            return key
    raise ConfigError(unknown_key_message(key))


def _split_values(text: str) -> list[str]:
    """Split on commas outside brackets: 'a,[1,2],b' -> ['a', '[1,2]', 'b']."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return parts


def _parse_scalar(text: str) -> Any:
    try:
        value = yaml.safe_load(text) if text.strip() else ""
    except yaml.YAMLError:
        return text
    if isinstance(value, str):  # YAML 1.1 reads '1e-4' as a string
        try:
            return float(value)
        except ValueError:
            pass
    return value


def parse_overrides(overrides: list[str]) -> dict[str, list[Any]]:
    """['depth=1,2', 'train.lr=1e-4'] -> {'drafter.depth': [1, 2], 'train.lr': [0.0001]} (each a grid axis)."""
    axes: dict[str, list[Any]] = {}
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE (e.g. depth=2 or depth=1,2,3,4)")
        key, _, raw = item.partition("=")
        full = resolve_key(key.strip())
        values = [_parse_scalar(v) for v in _split_values(raw)]
        if any(v == "" for v in values):
            raise ConfigError(f"override {item!r}: empty value for {full}")
        axes[full] = values
    return axes


def _set(tree: dict, dotted: str, value: Any) -> None:
    node = tree
    parts = dotted.split(".")
    for p in parts[:-1]:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError(f"key {dotted!r}: {p!r} is not a section")
    node[parts[-1]] = value


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _validate(tree: dict, origin: str) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = ".".join(str(p) for p in err["loc"])
        bad = err.get("input")
        got = f" (got {bad!r})" if not isinstance(bad, dict) else ""
        if err["type"] == "extra_forbidden":
            siblings = _sibling_keys([str(p) for p in err["loc"]])
            raise ConfigError(f"{origin}: {unknown_key_message(loc, siblings + LEAF_KEYS)}") from None
        raise ConfigError(f"{origin}: {loc}: {err['msg']}{got}") from None


def _sibling_keys(loc: list[str]) -> list[str]:
    """Dotted names of the fields beside an unknown one (so `studies.depth.grdi` can suggest its `grid`)."""
    model: Any = Config
    prefix: list[str] = []
    parts = loc[:-1]
    i = 0
    while i < len(parts):
        field = model.model_fields.get(parts[i]) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return []
        prefix.append(parts[i])
        model, i = field.annotation, i + 1
        args = getattr(model, "__args__", ())
        if getattr(model, "__origin__", None) is dict and len(args) == 2 and i < len(parts):
            prefix.append(parts[i])   # a dict of sections (studies.<name>): the next part is a name, not a field
            model, i = args[1], i + 1
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return []
    return [".".join(prefix + [name]) for name in model.model_fields]


# -- profiles ----------------------------------------------------------------------------------------------------

def profile_path(profile: str | None, root: Path | None = None) -> Path:
    """None -> <root>/params.yaml (the DVC workspace's params); 'default' -> the project's params.yaml;
    a name -> profiles/<name>.yaml; a path -> itself."""
    if profile in (None, ""):
        local = Path(root or Path.cwd()) / "params.yaml"
        return local if local.exists() else ROOT / "params.yaml"
    if profile == "default":
        return ROOT / "params.yaml"
    p = Path(profile)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    named = PROFILES_DIR / f"{profile}.yaml"
    if not named.exists():
        known = ["default"] + sorted(x.stem for x in PROFILES_DIR.glob("*.yaml"))
        raise ConfigError(f"unknown profile {profile!r}; choices: {', '.join(known)}")
    return named


def load_tree(profile: str | None, root: Path | None = None) -> dict:
    path = profile_path(profile, root)
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path.name}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path.name}: expected a mapping of sections at the top level")
    return tree


def load_config(profile: str | None = None, overrides: list[str] | None = None, root: Path | None = None) -> Config:
    """Load and validate a profile with single-valued overrides applied."""
    axes = parse_overrides(overrides or [])
    multi = [k for k, v in axes.items() if len(v) > 1]
    if multi:
        raise ConfigError(f"grid values for {', '.join(multi)} are only for `kvshot sweep`")
    tree = load_tree(profile, root)
    for key, (value,) in axes.items():
        _set(tree, key, value)
    return _validate(tree, f"profile {profile or 'default'}")


def with_values(base: Config, values: dict[str, Any], origin: str = "override") -> Config:
    """A copy of `base` with dotted-key values applied and re-validated."""
    tree = base.model_dump()
    for key, value in values.items():
        _set(tree, resolve_key(key), value)
    return _validate(tree, origin)


def expand_grid(base: Config, axes: dict[str, list[Any]]) -> list[tuple[dict[str, Any], Config]]:
    """Cartesian product of the axes over `base`: [(the values that vary, resolved config), ...]."""
    keys = list(axes)
    trials = []
    for combo in itertools.product(*(axes[k] for k in keys)):
        values = dict(zip(keys, combo))
        desc = ", ".join(f"{k}={v}" for k, v in values.items())
        trials.append((values, with_values(base, values, origin=desc or "base")))
    return trials


def check_hardware(cfg: Config) -> None:
    """Fail fast, before any work, when the profile needs a GPU this machine lacks. Imports torch only where it
    must ask it (a GPU, or bf16 on a CPU): `kvshot repro`, which only runs DVC, stays without it."""
    if cfg.require_cuda or cfg.target.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(f"profile {cfg.profile!r} needs a CUDA GPU (target.device={cfg.target.device!r}) "
                              "and none is available on this machine")
    note = precision_warning(cfg)
    if note and os.environ.get(WARNED_ENV) != note:
        os.environ[WARNED_ENV] = note           # inherited: `kvshot repro`'s stages do not print it again
        print(note, file=sys.stderr)


WARNED_ENV = "KVSHOT_PRECISION_WARNED"


def precision_warning(cfg: Config, native: bool | None = None) -> str | None:
    """One line when the config computes in bf16 on a CPU that only emulates it (no AVX512_BF16 / AMX), where
    bf16 runs several times slower than fp32; `native` overrides the detection (tests). None when all is well."""
    # the forwards over whole conversations (features) and training are where emulation costs (4-25x); decode
    # steps, a few rows each, cost about the same in both, so e2e.dtype is left out
    keys = [k for k, bf16 in (("target.dtype", cfg.target.dtype != "float32"),
                              ("train.precision", cfg.train.precision == "bf16")) if bf16]
    if not keys or cfg.target.device.startswith("cuda"):
        return None                    # nothing to ask torch (it is imported only past here)
    from models.target import resolve_device
    from stages.common import native_bf16

    if resolve_device(cfg.target.device) != "cpu" or (native if native is not None else native_bf16("cpu")):
        return None
    fix = " ".join({"target.dtype": "target.dtype=float32", "train.precision": "train.precision=fp32"}[k]
                   for k in keys)
    return (f"warning: {' and '.join(keys)} ask for bf16, which this CPU only emulates (no native bf16 matmuls): "
            f"features and training run 4-25x slower than in fp32 here (benchmarks/precision.py measures it); "
            f"{fix} is faster (as overrides, or in the profile's YAML for kvshot repro; fp32 numerics: the trials "
            f"get new fingerprints)")

def flatten(cfg: Config | dict, prefix: str = "") -> dict[str, Any]:
    """Every resolved value as a dotted key (MLflow params, fingerprints)."""
    tree = cfg.model_dump() if isinstance(cfg, BaseModel) else cfg
    out: dict[str, Any] = {}
    for k, v in tree.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
