"""The config tree: every shipped file composes, and mistakes fail at compose time with the key named."""

import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from lm.base.exits import Refused
from lm.config import to_objects

from ..conftest import CONF

EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))
GROUP_OPTIONS = sorted(
    (group.name, option.stem)
    for group in CONF.iterdir()
    if group.is_dir() and group.name != "experiment"
    for option in group.glob("*.yaml")
)


def unapplied(composed, wanted, key: str = "") -> list[str]:
    """Keys of `wanted` (a file's values, unresolved) whose value the composed tree does not hold; a list item
    is matched on the keys the file gives (the schema fills in the rest)."""
    if isinstance(wanted, dict):
        if not isinstance(composed, dict):
            return [key]
        return [m for k, v in wanted.items() for m in unapplied(composed.get(k), v, f"{key}.{k}".lstrip("."))]
    if isinstance(wanted, list):
        if not isinstance(composed, list) or len(composed) != len(wanted):
            return [key]
        return [m for i, (c, w) in enumerate(zip(composed, wanted)) for m in unapplied(c, w, f"{key}[{i}]")]
    return [] if composed == wanted else [f"{key}: file {wanted!r}, composed {composed!r}"]


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_every_experiment_composes_and_validates(compose, name):
    cfg = compose(f"+experiment={name}")
    to_objects(cfg)
    raw = OmegaConf.to_container(OmegaConf.load(CONF / "experiment" / f"{name}.yaml"), resolve=False)
    sets = {k: v for k, v in raw.items() if k not in ("defaults", "hydra")}
    assert sets, f"experiment {name} sets no key"
    # Every value the experiment sets reaches the run (no later defaults entry, such as a recipe, undoes it).
    missing = unapplied(OmegaConf.to_container(cfg, resolve=False), sets)
    assert not missing, f"experiment/{name}.yaml's values lost in composition: {missing}"


def test_a_lost_experiment_value_is_named(compose):
    """The check above can fail: a value overridden after the experiment (here from the command line) is named."""
    raw = OmegaConf.to_container(OmegaConf.load(CONF / "experiment" / "smoke.yaml"), resolve=False)
    cfg = OmegaConf.to_container(compose("+experiment=smoke", "run.name=other"), resolve=False)
    assert unapplied(cfg, {"run": raw["run"]}) == ["run.name: file 'smoke', composed 'other'"]


@pytest.mark.parametrize(("group", "option"), GROUP_OPTIONS)
def test_every_group_option_composes(compose, group, option):
    to_objects(compose(f"{group}={option}"))


def test_bare_defaults_are_the_smoke_experiment(compose):
    assert OmegaConf.to_container(compose()) == OmegaConf.to_container(compose("+experiment=smoke"))
    cfg = to_objects(compose())
    assert (cfg.data.source, cfg.run.name, cfg.precision.mode, cfg.kernels.compile) == (
        "stdlib",
        "smoke",
        "auto",
        None,
    )


def test_the_1b_plan_phases(compose):
    phases = [to_objects(compose(f"+experiment=phase{i}")) for i in range(1, 5)]
    assert [p.trainer.max_steps for p in phases] == [200, 10_000, 60_000, 90_000]
    assert [p.activation_checkpointing.every for p in phases] == [1, 1, 0, 0]
    for p in phases:
        assert p.run.name == "plan_1b"  # one run directory, continued phase after phase
        assert (p.model.n_layer, p.model.d_model, p.model.vocab_size, p.data.seq_len) == (
            18,
            2048,
            32000,
            2048,
        )
        assert p.model.max_seq_len == 2048
        assert (p.precision.mode, p.kernels.compile) == ("bf16-mixed", True)
        assert p.optim.total_steps == 90_000  # the schedule spans the plan, not the phase
        tokens_per_step = p.data.batch_size * p.data.seq_len * p.trainer.accumulate_grad_batches
        assert tokens_per_step == 131_072  # 90K steps = 11.8B tokens, the article's run


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("model.n_layr=3", "model.n_layr"),
        ("trainer.max_step=10", "trainer.max_step"),
        ("model.n_layer=abc", "model.n_layer"),
        ("data.batch_size=1.5", "data.batch_size"),
    ],
)
def test_typos_and_wrong_types_fail_at_compose_time(compose, override, named):
    with pytest.raises(ConfigCompositionException, match=named.replace(".", r"\.")):
        compose(override)


def test_a_typo_inside_an_experiment_file_fails_at_compose_time(tmp_path):
    conf = tmp_path / "conf"
    shutil.copytree(CONF, conf)
    (conf / "experiment" / "typo.yaml").write_text("# @package _global_\nmodel:\n  n_layers: 3\n")
    with (
        initialize_config_dir(config_dir=str(conf), version_base="1.3"),
        pytest.raises(ConfigCompositionException) as err,
    ):
        compose("train", overrides=["+experiment=typo"])
    assert "n_layers" in str(err.value.__cause__ or err.value)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.n_head=3", "model.d_model=128 is not divisible by model.n_head=3"),
        ("precision.mode=bf17", "precision.mode='bf17' is unknown"),
        ("optim.schedule=linear", "optim.schedule='linear' is unknown"),
        ("trainer.max_steps=0", "trainer.max_steps=0 must be a positive number of optimizer steps"),
        ("trainer.max_steps=-1", "trainer.max_steps=-1 must be a positive number of optimizer steps"),
        (
            "trainer.val_every_steps=0",
            "trainer.val_every_steps=0 must be a positive number of optimizer steps",
        ),
        ("trainer.accumulate_grad_batches=0", "trainer.accumulate_grad_batches=0 must be a positive"),
        ("trainer.limit_val_batches=-1", "trainer.limit_val_batches=-1 must be >= 0"),
        ("data.batch_size=0", "data.batch_size=0 must be >= 1"),
        ("data.verify=sometimes", "data.verify='sometimes' is unknown"),
        ("model.max_seq_len=128", "model.max_seq_len=128 is shorter than data.seq_len=256"),
        ("model.vocab_size=1000", "model.vocab_size=1000 is smaller than data.vocab_size=4096"),
        ("data.cache_dir=${oc.env:LM_NO_SUCH_VARIABLE}", "the config does not resolve"),
    ],
)
def test_values_that_clash_fail_before_anything_is_built(compose, override, message):
    with pytest.raises(Refused, match=message.replace("(", r"\(").replace(".", r"\.")):
        to_objects(compose(override))


def test_cli_config_prints_the_composed_tree(capsys, monkeypatch, data_cache):
    from lm.cli import main

    monkeypatch.setenv("LM_CONF", str(CONF))
    main(["config", "model=134m", f"data.cache_dir={data_cache}"])
    printed = OmegaConf.create(capsys.readouterr().out)
    assert printed.model.n_layer == 12 and printed.model.d_model == 768


def test_conf_dir_is_found_from_any_working_directory(tmp_path, monkeypatch):
    from lm.config import conf_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("LM_CONF", raising=False)
    assert conf_dir() == Path(CONF)
