"""Metrics writers: JSONL content and order, TensorBoard events, Weights & Biases (offline),
the writer registry and `config.metrics`, console line."""

import json
import os
import sys

import numpy as np
import pytest

from hgpo_jax.training import experiment
from hgpo_jax.training import metrics
from hgpo_jax.training import run_records


def test_jsonl_sorted_deterministic_and_tensorboard(tmp_path):
  m = {"loss": np.float32(0.5), "kl": 0.25, "env": {"success": np.array(0.75)}, "count": 3}
  for run in ("a", "b"):
    with metrics.MetricsWriter(str(tmp_path / run)) as w:
      w.write(1, m)
      w.write(2, dict(reversed(list(m.items()))))
  a = (tmp_path / "a" / metrics.JSONL_NAME).read_text()
  assert a == (tmp_path / "b" / metrics.JSONL_NAME).read_text()
  lines = a.splitlines()
  assert lines[0] == lines[1].replace('"step": 2', '"step": 1')
  assert list(json.loads(lines[0])) == ["step", "count", "env/success", "kl", "loss"]
  recs = run_records.read_metrics(str(tmp_path / "a"))
  assert recs[1]["env/success"] == 0.75 and recs[0]["count"] == 3
  events = os.listdir(tmp_path / "a" / metrics.TENSORBOARD_DIR)
  assert any(e.startswith("events.out.tfevents") for e in events)


def test_format_summary():
  line = metrics.format_summary(7, {"loss": -0.012345678, "kl": 0.003, "n": 4})
  assert line == "step 7 | kl 0.003 | loss -0.01235 | n 4"
  assert metrics.format_summary(7, {"loss": 1.0, "kl": 2.0}, keys=["loss"]) == "step 7 | loss 1"


def test_non_scalar_metric_is_rejected():
  with pytest.raises(ValueError, match="log scalars only"):
    metrics.to_scalars({"x": np.zeros(3)})


# ------------------------------------------------------------------ the writers
def test_the_registered_writers():
  assert metrics.WRITERS.names() == ["jsonl", "tensorboard", "wandb"]
  with pytest.raises(KeyError) as info:
    metrics.WRITERS.get("mlflow")
  assert info.value.args[0] == ("unknown metric writer 'mlflow'; registered: "
                                "['jsonl', 'tensorboard', 'wandb']")


def test_jsonl_is_always_written_and_the_same_whatever_else_is(tmp_path):
  m = {"loss": np.float32(0.5), "env": {"success": np.array(0.75)}}
  for run, writers in (("default", None), ("plain", ()), ("listed", ("jsonl", "tensorboard"))):
    kwargs = {} if writers is None else {"writers": writers}
    with metrics.MetricsWriter(str(tmp_path / run), **kwargs) as w:
      assert w.write(3, m) == {"env/success": 0.75, "loss": 0.5}
  text = (tmp_path / "default" / metrics.JSONL_NAME).read_text()
  assert text == '{"step": 3, "env/success": 0.75, "loss": 0.5}\n'
  for run in ("plain", "listed"):
    assert (tmp_path / run / metrics.JSONL_NAME).read_text() == text
  assert sorted(os.listdir(tmp_path / "plain")) == [metrics.JSONL_NAME]
  assert (tmp_path / "listed" / metrics.TENSORBOARD_DIR).is_dir()


def test_an_unknown_writer_opens_no_file(tmp_path):
  with pytest.raises(KeyError, match=r"unknown metric writer 'mlflow'; registered: \["):
    metrics.MetricsWriter(str(tmp_path), ("tensorboard", "mlflow"))
  assert os.listdir(tmp_path) == []


def test_the_wandb_writer_records_every_scalar_offline(tmp_path, monkeypatch):
  """The W&B run the writer opens (offline): its project, name and config, each write's
  scalars at its step (the run's history, as `wandb.log` receives them) and the offline run
  directory under WANDB_DIR, or else the run directory."""
  wandb = pytest.importorskip("wandb")
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
  monkeypatch.setenv("WANDB_SILENT", "true")
  (tmp_path / "wandb_dir").mkdir()
  logged = []
  log = wandb.sdk.wandb_run.Run.log

  def recording_log(run, data, step=None, **kwargs):
    logged.append((step, dict(data)))
    return log(run, data, step=step, **kwargs)
  monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", recording_log)
  settings = metrics.WriterSettings(wandb_project="hgpo", run_config={"seed": 3})
  with metrics.MetricsWriter(str(tmp_path / "run7"), ("wandb",), settings) as w:
    w.write(1, {"loss": 0.5, "env": {"success": 0.25}})
    w.write(2, {"loss": 0.125, "env": {"success": 1.0}})
    run = w._writers[-1]._run
    assert (run.project, run.name, run.config["seed"]) == ("hgpo", "run7", 3)
  assert logged == [(1, {"env/success": 0.25, "loss": 0.5}), (2, {"env/success": 1.0, "loss": 0.125})]
  assert len(list((tmp_path / "wandb_dir" / "wandb").glob("offline-run-*/run-*.wandb"))) == 1
  # without WANDB_DIR the W&B run lives in the run directory, beside metrics.jsonl
  monkeypatch.delenv("WANDB_DIR")
  with metrics.MetricsWriter(str(tmp_path / "run8"), ("wandb",), settings) as w:
    w.write(1, {"loss": 0.5})
  assert list((tmp_path / "run8" / "wandb").glob("offline-run-*/run-*.wandb"))
  assert (tmp_path / "run8" / metrics.JSONL_NAME).exists()


def test_wandb_missing_is_one_line_naming_pip_install(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
  message = ("metric writer 'wandb' needs the wandb package, which is not installed: "
             "pip install wandb (or leave 'wandb' out of config.metrics.writers)")
  assert metrics.missing_package("wandb") == message
  assert metrics.missing_package("tensorboard") is None and metrics.missing_package("jsonl") is None
  with pytest.raises(ImportError) as info:
    metrics.MetricsWriter(str(tmp_path), ("wandb",))
  assert str(info.value) == message
  from hgpo_jax import train
  with pytest.raises(train.ConfigError) as info:
    experiment.from_config(_config(**{"metrics.writers": ("tensorboard", "wandb")}))
  assert str(info.value) == f"config.metrics.writers: {message}"


# ------------------------------------------------------------------ config.metrics
def _config(**overrides):
  from configs import sokoban
  c = sokoban.get_config("algo=grpo,smoke")
  with c.unlocked():
    c.update_from_flattened_dict(overrides)
  return c


@pytest.mark.parametrize("overrides,message", [
    ({"metrics.writers": ("tensorboard", "mlflow")},
     "config.metrics.writers: unknown metric writer 'mlflow'; registered: "
     "['jsonl', 'tensorboard', 'wandb']"),
    ({"metrics.wandb_mode": "cloud"},
     "config.metrics: wandb_mode='cloud': use one of ('online', 'offline', 'disabled')"),
])
def test_bad_metrics_settings_end_in_one_line(overrides, message):
  from hgpo_jax import train
  with pytest.raises(train.ConfigError) as info:
    experiment.from_config(_config(**overrides))
  assert str(info.value) == message


def test_the_trainer_writes_tensorboard_by_default_and_evaluation_its_record_only(tmp_path):
  from hgpo_jax.training import run as run_lib
  exp = experiment.from_config(_config())
  assert exp.metrics.writers == ("tensorboard",)
  assert exp.metrics.settings() == metrics.WriterSettings()
  for name, is_train in (("train", True), ("eval", False)):
    writer = run_lib.metrics_writer(exp, str(tmp_path / name), train=is_train)
    writer.write(1, {"loss": 0.5})
    writer.close()
  assert sorted(os.listdir(tmp_path / "train")) == [metrics.JSONL_NAME, metrics.TENSORBOARD_DIR]
  assert os.listdir(tmp_path / "eval") == [metrics.JSONL_NAME]
