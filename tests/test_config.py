"""Profiles validate; the override grammar resolves keys, builds grid axes and rejects bad input with one line."""
import pytest
import yaml

from pipeline.config import (ConfigError, expand_grid, flatten, load_config, parse_overrides, profile_path,
                             resolve_key, check_hardware, precision_warning)


@pytest.mark.parametrize("profile", ["default", "smoke", "paper"])
def test_every_profile_validates(profile):
    cfg = load_config(profile)
    assert cfg.profile == profile
    assert set(cfg.studies) == {"injection", "depth", "hybrid", "scale", "block"}


def test_profiles_share_the_schema_of_params_yaml():
    default = set(yaml.safe_load(profile_path("default").read_text()))
    for name in ("smoke", "paper"):
        assert set(yaml.safe_load(profile_path(name).read_text())) <= default | {"require_cuda"}


def test_short_keys_resolve_when_unambiguous():
    assert resolve_key("depth") == "drafter.depth"
    assert resolve_key("variant") == "drafter.variant"
    assert resolve_key("seed") == "train.seed"
    assert resolve_key("eval.data") == "eval.data"
    assert resolve_key("data.scales.small") == "data.scales.small"


def test_ambiguous_and_unknown_keys_list_choices():
    with pytest.raises(ConfigError, match="ambiguous key 'max_new_tokens'.*regenerate.max_new_tokens.*e2e.max_new_tokens"):
        resolve_key("max_new_tokens")
    with pytest.raises(ConfigError, match=r"unknown key 'bogus' \(`kvshot keys` lists all\)$"):
        parse_overrides(["bogus=1"])


@pytest.mark.parametrize("key, guess", [
    ("dpeth", "drafter.depth"), ("drafter.dpeth", "drafter.depth"), ("trian.lr", "train.lr"),
    ("max_concurent", "ray.max_concurrent"), ("max_new_token", "regenerate.max_new_tokens or e2e.max_new_tokens"),
])
def test_unknown_keys_suggest_the_closest_never_the_whole_list(key, guess):
    with pytest.raises(ConfigError) as info:
        parse_overrides([f"{key}=1"])
    assert str(info.value) == f"unknown key {key!r}; did you mean {guess}? (`kvshot keys` lists all)"


def test_unknown_keys_in_a_profile_suggest_their_neighbours(tmp_path):
    for section, guess in (("drafter:\n  dpeth: 2\n", "drafter.depth"), ("trian:\n  lr: 0.1\n", "train"),
                           ("studies:\n  depth:\n    grdi: {}\n", "studies.depth.grid")):
        (tmp_path / "p.yaml").write_text(section)
        with pytest.raises(ConfigError, match=f"did you mean {guess}\\? \\(`kvshot keys` lists all\\)") as info:
            load_config(str(tmp_path / "p.yaml"))
        assert len(str(info.value).split(": ", 1)[1]) < 100   # never the ~90 valid keys


def test_grid_axes_and_list_values():
    axes = parse_overrides(["depth=1,2,3,4", "e2e.paper_tree=[8,10,60]", "rope_fix=true,false", "lr=1e-4"])
    assert axes == {"drafter.depth": [1, 2, 3, 4], "e2e.paper_tree": [[8, 10, 60]],
                    "drafter.rope_fix": [True, False], "train.lr": [1e-4]}
    trials = expand_grid(load_config("smoke"), {"drafter.depth": [1, 2], "drafter.rope_fix": [True, False]})
    assert len(trials) == 4
    assert {(c.drafter.depth, c.drafter.rope_fix) for _, c in trials} == {(1, True), (1, False), (2, True), (2, False)}


@pytest.mark.parametrize("override, needle", [
    (["depth=two"], "drafter.depth.*'two'"),
    (["variant=medusa"], "drafter.variant.*'medusa'"),
    (["lr=-1"], "train.lr"),
    (["depth"], "expected KEY=VALUE"),
    (["depth="], "empty value"),
    (["depth=1,2"], "only for `kvshot sweep`"),
])
def test_bad_values_are_one_line_errors(override, needle):
    with pytest.raises(ConfigError, match=needle) as info:
        load_config("smoke", override)
    assert "\n" not in str(info.value)


def test_unknown_profile_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="unknown profile 'nope'; choices: default, paper, smoke"):
        load_config("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("drafter: {depth: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(str(bad))
    extra = tmp_path / "extra.yaml"
    extra.write_text("drafter: {detph: 2}\n")
    with pytest.raises(ConfigError, match="drafter.detph.; did you mean drafter.depth"):
        load_config(str(extra))


def test_paper_profile_fails_fast_without_cuda():
    import torch

    cfg = load_config("paper")
    assert cfg.target.source == "Qwen/Qwen3-8B" and cfg.data.scales == {"small": 70000, "large": 280000}
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ConfigError, match="needs a CUDA GPU"):
        check_hardware(cfg)


def test_bf16_on_a_cpu_that_emulates_it_is_named_with_the_faster_overrides():
    cfg = load_config("study")
    note = precision_warning(cfg, native=False)
    assert note.startswith("warning: target.dtype and train.precision ask for bf16")
    assert "target.dtype=float32 train.precision=fp32 is faster" in note and "\n" not in note
    assert precision_warning(cfg, native=True) is None
    only_train = load_config("study", ["target.dtype=float32"])
    assert "train.precision=fp32 is faster" in precision_warning(only_train, native=False)
    fp32 = load_config("study", ["target.dtype=float32", "train.precision=fp32"])
    assert precision_warning(fp32, native=False) is None
    assert precision_warning(load_config("paper"), native=False) is None     # a CUDA profile: not this check


def test_check_hardware_prints_the_bf16_warning_once_per_command_tree(monkeypatch, capsys):
    import os
    import subprocess
    import sys

    import pipeline.config as config
    import stages.common

    monkeypatch.setattr(stages.common, "native_bf16", lambda device="cpu": False)
    monkeypatch.setenv(config.WARNED_ENV, "")          # restored (unset) after the test
    cfg = load_config("study")
    check_hardware(cfg)
    check_hardware(cfg)
    assert capsys.readouterr().err.count("which this CPU only emulates") == 1
    # a stage that `kvshot repro` starts inherits the mark and stays quiet; another config's warning still prints
    child = subprocess.run([sys.executable, "-c", f"import os; print(os.environ[{config.WARNED_ENV!r}])"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == precision_warning(cfg, native=False)
    check_hardware(load_config("study", ["target.dtype=float32"]))
    assert "train.precision=fp32 is faster" in capsys.readouterr().err


def test_native_bf16_agrees_with_onednn():
    import torch
    from stages.common import native_bf16

    assert native_bf16("cpu") is bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def test_flatten_lists_every_leaf():
    flat = flatten(load_config("smoke"))
    assert flat["drafter.variant"] == "kv_only" and "train.lr" in flat and "data.scales.small" in flat


def test_options_added_later_keep_old_config_hashes_while_off():
    """The settings part of a fingerprint stays comparable across versions (the code hash changes with the code)."""
    from pipeline.config import load_config, with_values
    from pipeline.fingerprint import config_hash

    cfg = load_config("smoke")
    old = cfg.model_dump()
    for key in ("fc_norm", "norm_output", "no_target", "block_size", "context", "token_context"):
        old["drafter"].pop(key)
    old["train"].pop("block_anchors")
    old["train"].pop("bucket_window")
    assert config_hash(cfg) == config_hash(old)
    assert config_hash(with_values(cfg, {"drafter.fc_norm": True})) != config_hash(cfg)


def test_the_schema_and_the_cli_import_no_torch_or_pandas():
    """`kvshot --help` and `kvshot keys` compute nothing: importing pipeline.config and pipeline.cli, and running
    `kvshot keys depth`, loads neither torch nor pandas (benchmarks/startup.py measures the start time)."""
    import subprocess
    import sys

    probe = ("import sys\n"
             "import pipeline.config, pipeline.cli\n"
             "from typer.testing import CliRunner\n"
             "out = CliRunner().invoke(pipeline.cli.app, ['keys', 'depth'])\n"
             "assert out.exit_code == 0 and 'drafter.depth' in out.output, out.output\n"
             "print(' '.join(m for m in ('torch', 'pandas', 'stages.train', 'stages.report') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"imported: {out.stdout.strip()}"
    # the probe can see an import: stages.train does load torch
    heavy = subprocess.run([sys.executable, "-c", probe.replace("import pipeline.config,", "import stages.train,")],
                           capture_output=True, text=True, timeout=120)
    assert "torch" in heavy.stdout.split(), heavy.stdout + heavy.stderr[-2000:]
