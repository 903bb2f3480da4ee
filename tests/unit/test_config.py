import tomllib

import pytest
from pydantic import ValidationError

from clawr1.cli.main import main
from clawr1.core.config import Config, EngineConfig, load_config, to_toml


def test_every_field_has_a_docstring():
    for model in (Config, EngineConfig):
        for name, field in model.model_fields.items():
            assert field.description, f"{model.__name__}.{name} has no docstring"


def test_file_then_overrides_then_validation(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text('data_dir = "/x"\n[engine]\nthreads = 3\nmax_batch = 4\n')
    config = load_config(path, ["engine.max_batch=16", 'engine.model="/some/dir"'])
    assert str(config.data_dir) == "/x"
    assert config.engine.threads == 3
    assert config.engine.max_batch == 16
    assert config.engine.model == "/some/dir"


@pytest.mark.parametrize("override", ["engine.max_batch=0", "engine.threads=-1", "engine.dtype=int8",
                                      "engine.nope=1", "engine.device=tpu", "trainer.stop_coef=-1"])
def test_out_of_bounds_or_unknown_is_rejected(override):
    with pytest.raises(ValidationError):
        load_config(None, [override])


@pytest.mark.parametrize("others", [['trainer.method="rl"'], ['trainer.method="combine"', 'trainer.opd_estimator="full"']])
def test_the_stop_term_needs_the_sampled_opd_teacher(others):
    with pytest.raises(ValidationError, match="stop_coef"):
        load_config(None, ["trainer.stop_coef=1", *others])
    load_config(None, ["trainer.stop_coef=1", 'trainer.method="combine"'])


def test_malformed_override():
    with pytest.raises(ValueError, match="key.path=value"):
        load_config(None, ["engine.threads"])


def test_printed_config_is_valid_toml_that_loads_back(tmp_path, capsys):
    assert main(["config", "--set", "engine.max_batch=12", "--threads", "2", "--data-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    data = tomllib.loads(printed)
    assert data["engine"]["max_batch"] == 12 and data["engine"]["threads"] == 2
    assert Config.model_validate(data) == load_config(None, ["engine.max_batch=12", "engine.threads=2",
                                                            f'data_dir="{tmp_path}"'])
    assert to_toml(Config.model_validate(data)) == printed


def test_cli_reports_bad_config_without_traceback(capsys):
    assert main(["config", "--set", "engine.max_batch=0"]) == 2
    assert "max_batch" in capsys.readouterr().err


def test_printed_config_redacts_keys(capsys):
    assert main(["config", "--set", 'gateway.api_keys=["sk-agent-secret"]',
                 "--set", 'gateway.admin_key="admin-secret-0123456789"']) == 0
    printed = capsys.readouterr().out
    assert "sk-agent-secret" not in printed and "admin-secret" not in printed
    assert "api_keys is set (redacted)" in printed
    tomllib.loads(printed)


def test_one_cuda_device_for_several_trainer_ranks_is_refused(monkeypatch):
    """`trainer.device = "cuda:1"` with several ranks put every rank on GPU 1 while each rank's
    NCCL communicator was bound to its own `cuda:LOCAL_RANK`: refused in the config (Ray ranks),
    by `clawr1 train --nproc` before it launches, and by a rank joining its group (torchrun)."""
    from clawr1.trainer.ranks import Ranks

    with pytest.raises(ValidationError, match="every rank on that one GPU"):
        load_config(None, ['trainer.device="cuda:1"', "ray.trainer_ranks=2"])
    assert load_config(None, ['trainer.device="cuda"', "ray.trainer_ranks=2"]).trainer.device == "cuda"
    assert load_config(None, ['trainer.device="cuda:1"']).trainer.device == "cuda:1"  # one rank: its GPU
    assert main(["train", "--nproc", "2", "--set", 'trainer.device="cuda:1"']) == 2
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="every rank on that one GPU"):
        Ranks.from_env("cuda:0")
