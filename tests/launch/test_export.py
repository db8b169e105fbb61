"""launch/export.py and hgpo_jax/models/hf_export.py: a policy out as a Hugging Face directory.

The references are transformers' `AutoModelForCausalLM` / `AutoTokenizer` (torch on CPU)
reading the written directory, and this project's `loading.load_hf_dir` reading it back.
Checkpoints are written with `checkpoint.Checkpointer` in the trainer's layout
(`TrainState.to_checkpoint`, the run's config JSON); a trained smoke run is in
tests/launch/test_evaluate_checkpoint.py.
"""

from __future__ import annotations

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from hgpo_jax.models import config as model_config
from hgpo_jax.models import critic as critic_lib
from hgpo_jax.models import hf_export
from hgpo_jax.models import loading
from hgpo_jax.models import tokenizer as tokenizer_lib
from hgpo_jax.models import weights
from hgpo_jax.training import checkpoint
from launch import export

TINY = model_config.get_preset("tiny")
RUN_CONFIG = {"model": {"name": "tiny", "path": "", "dtype": "float32"}, "seed": 0}


def _variant(kind: str) -> model_config.ModelConfig:
  """The tiny preset as each exported family: llama (tied), qwen2 (biases, untied), qwen3
  (q/k norms, head_dim != hidden/heads) and a GGUF-style llama (interleaved RoPE)."""
  if kind == "qwen2":
    return TINY.replace(qkv_bias=True, tie_embeddings=False)
  if kind == "qwen3":
    return TINY.replace(qk_norm=True, head_dim=8, tie_embeddings=False)
  if kind == "interleaved":
    return TINY.replace(rope_layout="interleaved")
  return TINY


def _random_params(cfg, seed: int) -> dict[str, np.ndarray]:
  """Flat Decoder params, norm scales and biases randomised too (a zero bias or a unit
  scale would hide a transposed or misnamed tensor)."""
  model = loading.init_model(cfg, seed=seed)
  params = export.flat_params(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  rng = np.random.default_rng(seed)
  for name, w in params.items():
    w = np.asarray(w)
    if name.endswith(("norm", "_bias")):
      w = (1.0 if name.endswith("norm") else 0.0) + 0.3 * rng.standard_normal(w.shape)
    params[name] = w.astype(np.float32)
  return params


def _tokens():
  """(tokens int32[2, 12], positions) of one chat prompt and random ids."""
  tok = tokenizer_lib.tiny_tokenizer()
  ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "go to fridge 1"}]))[:12]
  rng = np.random.default_rng(0)
  tokens = np.stack([ids + [3] * (12 - len(ids)), rng.integers(3, 512, 12)]).astype(np.int32)
  return tokens, np.broadcast_to(np.arange(12, dtype=np.int32), tokens.shape)


def _project_logits(cfg, params) -> np.ndarray:
  tokens, positions = _tokens()
  model = loading.model_from_params(cfg, params)
  logits, _ = model(tokens, positions, np.ones(tokens.shape, bool))
  return np.asarray(logits)


def _transformers_logits(directory: str, dtype=None) -> np.ndarray:
  import torch
  import transformers
  model = transformers.AutoModelForCausalLM.from_pretrained(
      directory, dtype=dtype or torch.float32, attn_implementation="eager").eval()
  tokens, positions = _tokens()
  with torch.no_grad():
    out = model(input_ids=torch.tensor(tokens, dtype=torch.long),
                position_ids=torch.tensor(positions, dtype=torch.long))
  return out.logits.float().numpy()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "interleaved"])
def test_export_equals_transformers_and_reads_back(tmp_path, kind):
  cfg = _variant(kind)
  params = _random_params(cfg, seed=1)
  want = _project_logits(cfg, params)
  out = str(tmp_path / "hf")
  os.makedirs(out)
  files = hf_export.write_model_dir(out, cfg, params, tokenizer=tokenizer_lib.tiny_tokenizer())
  assert sorted(files) == sorted(os.listdir(out)) == [
      "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
      "tokenizer_config.json"]
  hf = json.load(open(os.path.join(out, "config.json")))
  assert hf["model_type"] == {"qwen2": "qwen2", "qwen3": "qwen3"}.get(kind, "llama")
  assert hf["dtype"] == "float32"
  scale = np.abs(want).max()
  np.testing.assert_allclose(_transformers_logits(out), want, atol=1e-5 * scale, rtol=0)
  # The project's loader reads it back: same architecture (in the "half" layout), logits.
  model, tok, back = loading.load_hf_dir(out)
  assert back.rope_layout == "half" and back.num_layers == cfg.num_layers
  tokens, positions = _tokens()
  logits, _ = model(tokens, positions, np.ones(tokens.shape, bool))
  np.testing.assert_allclose(np.asarray(logits), want, atol=1e-5 * scale, rtol=0)
  assert tok.chat_template == tokenizer_lib.tiny_tokenizer().chat_template


def test_written_tokenizer_loads_in_transformers(tmp_path):
  """tokenizer.json + tokenizer_config.json of a tokenizer without HF files (tiny, GGUF):
  AutoTokenizer encodes, decodes and renders the chat template as the project does."""
  import transformers
  tok = tokenizer_lib.tiny_tokenizer()
  hf_export.write_tokenizer(str(tmp_path), tok)
  hf_export.write_generation_config(str(tmp_path), tok)
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  messages = [{"role": "system", "content": "You are an agent."},
              {"role": "user", "content": "Ünïcödé: go to cabinet 12"}]
  prompt = tok.apply_chat_template(messages)
  assert hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == prompt
  ids = tok.encode(prompt)
  assert hf_tok(prompt, add_special_tokens=False)["input_ids"] == ids
  assert hf_tok.decode(ids) == tok.decode(ids, skip_special_tokens=False)
  assert hf_tok.eos_token == "<|im_end|>" and hf_tok.pad_token == "<|endoftext|>"
  gen = json.load(open(tmp_path / "generation_config.json"))
  assert gen == {"eos_token_id": [2, 0], "pad_token_id": 0}
  # and the project's reader agrees
  back = tokenizer_lib.Tokenizer.from_hf_dir(str(tmp_path))
  assert back.eos_ids == tok.eos_ids and back.pad_id == tok.pad_id and back.encode(prompt) == ids


def test_shards_and_index_above_the_size_limit(tmp_path):
  cfg = _variant("qwen2")
  params = _random_params(cfg, seed=2)
  tensors = weights.hf_tensors(cfg, params)
  limit = 100_000  # bytes: the 131 kB embedding alone, then layers in groups
  plan = hf_export.shard_names(tensors, limit)
  # every tensor once (one above the limit gets a shard of its own where it comes)
  assert sorted(n for names in plan for n in names) == sorted(tensors)
  for names in plan:  # each shard under the limit unless it is one larger tensor
    assert len(names) == 1 or sum(tensors[n].nbytes for n in names) <= limit
  out = str(tmp_path / "hf")
  os.makedirs(out)
  hf_export.write_model_dir(out, cfg, params, tokenizer=tokenizer_lib.tiny_tokenizer(),
                            max_shard_bytes=limit)
  index = json.load(open(os.path.join(out, "model.safetensors.index.json")))
  shards = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
  assert len(shards) == len(plan) > 2
  assert shards[0] == f"model-00001-of-{len(plan):05d}.safetensors"
  assert sorted(set(index["weight_map"].values())) == shards
  assert index["metadata"]["total_size"] == sum(w.nbytes for w in tensors.values())
  want = _project_logits(cfg, params)
  scale = np.abs(want).max()
  np.testing.assert_allclose(_transformers_logits(out), want, atol=1e-5 * scale, rtol=0)
  model, _, _ = loading.load_hf_dir(out)
  tokens, positions = _tokens()
  np.testing.assert_array_equal(np.asarray(model(tokens, positions, np.ones(tokens.shape, bool))[0]),
                                np.asarray(loading.model_from_params(cfg, params)(
                                    tokens, positions, np.ones(tokens.shape, bool))[0]))


@pytest.mark.parametrize("text,size", [("5GB", 5 * 10**9), ("2MiB", 2 * 2**20), ("500kb", 500_000),
                                       ("1024", 1024), (77, 77)])
def test_shard_sizes_read_as_transformers_reads_them(text, size):
  from transformers.utils import hub
  assert hf_export.parse_size(text) == size
  if isinstance(text, str) and text[-1].isalpha() and text.upper() == text:
    assert hub.convert_file_size_to_int(text) == size


# ------------------------------------------------------------------------------ the CLI
def _save_run(workdir, steps: dict[int, dict], config=None, critic=None) -> str:
  """A run's checkpoints/ as the trainer writes them: per step the policy params (nested,
  `TrainState.to_checkpoint`), an optimizer state and the run's config JSON."""
  ckpt_dir = os.path.join(workdir, "checkpoints")
  with checkpoint.Checkpointer(ckpt_dir, async_save=False) as ckpt:
    for step, params in steps.items():
      nested = {}
      for name, w in params.items():
        *outer, leaf = name.split("/")
        node = nested
        for key in outer:
          node = node.setdefault(key, {})
        node[leaf] = w
      tree = {"params": nested, "opt_state": {"mu": jax.tree.map(np.zeros_like, nested)},
              "step": np.int32(step)}
      if critic is not None:
        tree["critic"] = {"params": critic, "opt_state": {}, "step": np.int32(step)}
      ckpt.save(step, tree, cursor={"iteration": step}, config=config or RUN_CONFIG)
  return ckpt_dir


def _cli(*args):
  return export.main([str(a) for a in args])


def test_cli_exports_the_latest_or_the_named_step(tmp_path, capsys):
  one, two = _random_params(TINY, seed=3), _random_params(TINY, seed=4)
  workdir = tmp_path / "run"
  _save_run(str(workdir), {1: one, 2: two})
  for step, params in ((None, two), (1, one)):
    out = tmp_path / f"out_{step}"
    assert _cli("--workdir", workdir, "--out", out, *(["--step", step] if step else [])) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (f"launch.export: step {step or 2} of {workdir}/checkpoints -> {out}")
    want = _project_logits(TINY, params)
    np.testing.assert_allclose(_transformers_logits(str(out)), want,
                               atol=1e-5 * np.abs(want).max(), rtol=0)
  # --overwrite replaces an export (here with fewer shards than before: none left behind)
  out = tmp_path / "out_1"
  assert _cli("--workdir", workdir, "--out", out, "--overwrite", "--max-shard-size", "1") == 0
  assert _cli("--workdir", workdir, "--out", out, "--overwrite") == 0
  assert sorted(f for f in os.listdir(out) if "safetensors" in f) == ["model.safetensors"]


def test_cli_bfloat16_export_is_the_rounded_policy(tmp_path):
  import safetensors.numpy
  import torch
  params = _random_params(TINY, seed=5)
  _save_run(str(tmp_path / "run"), {3: params})
  out = tmp_path / "bf16"
  assert _cli("--workdir", tmp_path / "run", "--out", out, "--dtype", "bfloat16") == 0
  assert json.load(open(out / "config.json"))["dtype"] == "bfloat16"
  saved = safetensors.numpy.load_file(str(out / "model.safetensors"))
  q0 = saved["model.layers.0.self_attn.q_proj.weight"]
  assert q0.dtype == ml_dtypes.bfloat16
  # round to nearest even of the float32 weights, nothing else
  np.testing.assert_array_equal(q0, params["layers/q"][0].reshape(q0.shape).astype(ml_dtypes.bfloat16))
  rounded = {n: w.astype(ml_dtypes.bfloat16).astype(np.float32) for n, w in params.items()}
  want = _project_logits(TINY, rounded)
  got = _transformers_logits(str(out), dtype=torch.float32)
  np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max(), rtol=0)


def test_cli_critic_layout(tmp_path):
  """DIR/critic: the backbone as a model directory and the heads beside it; transformers'
  last hidden state through the heads gives the Critic's values (column t + 1)."""
  policy = _random_params(TINY, seed=6)
  critic = critic_lib.params_from_policy(_nested(_random_params(TINY, seed=7)), TINY, 3, seed=1)
  critic = jax.tree.map(np.asarray, critic)
  critic["value_bias"] = np.array([0.1, -0.2, 0.3], np.float32)
  _save_run(str(tmp_path / "run"), {1: policy}, critic=critic)
  out = tmp_path / "out"
  assert _cli("--workdir", tmp_path / "run", "--out", out, "--critic") == 0
  assert json.load(open(out / "critic" / "value_heads.json"))["heads"] == ["low", "high", "term"]
  want = _critic_values(TINY, critic)
  np.testing.assert_allclose(_exported_critic_values(out)[:, :-1], want[:, 1:], atol=1e-5,
                             rtol=1e-5)
  # the policy directory is the policy's, not the critic's
  np.testing.assert_allclose(_transformers_logits(str(out)), _project_logits(TINY, policy),
                             atol=1e-4, rtol=0)
  # an export over it without --critic leaves no stale value model behind
  assert _cli("--workdir", tmp_path / "run", "--out", out, "--overwrite") == 0
  assert not (out / "critic").exists() and (out / "model.safetensors").is_file()


def _critic_values(cfg, critic: dict) -> np.ndarray:
  """f32[B, T, H] values of the project's Critic with the pure params `critic` on `_tokens`."""
  model = critic_lib.Critic(cfg, int(critic["value_head"].shape[0]), rngs=nnx.Rngs(0))
  nnx.update(model, _state(model, critic))
  tokens, positions = _tokens()
  return np.asarray(model.values(tokens, positions, np.ones(tokens.shape, bool)))


def _exported_critic_values(out) -> np.ndarray:
  """The values of an export's OUT/critic through transformers: its base model's last
  hidden state through the written heads (column t = the value of token t + 1)."""
  import safetensors.numpy
  import torch
  import transformers
  heads = safetensors.numpy.load_file(str(out / "critic" / "value_heads.safetensors"))
  backbone = transformers.AutoModelForCausalLM.from_pretrained(
      str(out / "critic"), dtype=torch.float32).eval()
  tokens, positions = _tokens()
  with torch.no_grad():
    hidden = backbone.model(input_ids=torch.tensor(tokens, dtype=torch.long),
                            position_ids=torch.tensor(positions, dtype=torch.long)
                            ).last_hidden_state.numpy()
  return hidden @ heads["value_head"].T + heads["value_bias"]


def test_cli_critic_of_a_lora_run_merges_the_critics_own_adapters(tmp_path, capsys):
  """A LoRA run saves adapters (and the critic's full-rank heads) only: --critic writes the
  base's backbone with the critic's adapters (not the policy's) merged, whose values
  through transformers equal the LoRA Critic's; --lora-adapter --critic is one line."""
  from hgpo_jax.models import lora
  targets = ("q_proj", "o_proj", "up_proj")
  model = loading.with_lora(loading.load_model("tiny", seed=0)[0],
                            lora.LoraConfig(rank=3, alpha=5.0, targets=targets))
  rng = np.random.default_rng(8)
  noise = lambda x: rng.normal(0, 0.2, np.shape(x)).astype(np.float32)  # noqa: E731
  policy = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
  critic = jax.tree.map(np.asarray, critic_lib.params_from_policy(policy, model.cfg, 3, seed=1))
  critic["backbone"]["layers"] = {k: (noise(v) if lora.is_adapter(k) else v)
                                  for k, v in critic["backbone"]["layers"].items()}
  critic["value_bias"] = np.array([0.1, -0.2, 0.3], np.float32)
  adapters = jax.tree.map(noise, lora.trainable_params(policy))
  config = dict(RUN_CONFIG, model=dict(RUN_CONFIG["model"], lora={
      "rank": 3, "alpha": 5.0, "targets": ",".join(targets), "rslora": False, "path": ""}))
  with checkpoint.Checkpointer(str(tmp_path / "run" / "checkpoints"), async_save=False) as ckpt:
    ckpt.save(1, {"params": adapters, "opt_state": {}, "step": np.int32(1),
                  "critic": {"params": lora.trainable_params(critic), "opt_state": {},
                             "step": np.int32(1)}},
              cursor={"iteration": 1}, config=config)
  out = tmp_path / "out"
  assert _cli("--workdir", tmp_path / "run", "--out", out, "--critic") == 0
  want = _critic_values(model.cfg, critic)
  np.testing.assert_allclose(_exported_critic_values(out)[:, :-1], want[:, 1:], atol=1e-5,
                             rtol=1e-5)
  # the policy's adapters in the critic's place give other values
  swapped = dict(critic, backbone=dict(critic["backbone"], layers={
      **critic["backbone"]["layers"], **adapters["layers"]}))
  assert np.abs(_critic_values(model.cfg, swapped) - want).max() > 1e-3
  capsys.readouterr()
  assert "--lora-adapter" in _err(capsys, _cli("--workdir", tmp_path / "run", "--out",
                                               tmp_path / "a", "--lora-adapter", "--critic"))


def _nested(flat):
  out = {}
  for name, w in flat.items():
    *outer, leaf = name.split("/")
    node = out
    for key in outer:
      node = node.setdefault(key, {})
    node[leaf] = w
  return out


def _state(model, pure):
  state = nnx.state(model, nnx.Param)
  nnx.replace_by_pure_dict(state, pure)
  return state


def _err(capsys, code):
  cap = capsys.readouterr()
  lines = cap.err.strip().splitlines()
  assert code == 2 and len(lines) == 1 and "Traceback" not in cap.err, cap.err
  assert lines[0].startswith("launch.export: error: "), lines
  return lines[0].removeprefix("launch.export: error: ")


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
  run = str(tmp_path / "run")
  ckpt_dir = _save_run(run, {1: _random_params(TINY, seed=8), 2: _random_params(TINY, seed=9)})
  empty = tmp_path / "empty"
  empty.mkdir()
  assert _err(capsys, _cli("--workdir", empty, "--out", tmp_path / "o")) == (
      f"{empty} holds no checkpoint (no step folders in {empty}/checkpoints or {empty}); "
      "pass the workdir of a run that saved one.")
  assert _err(capsys, _cli("--workdir", run, "--out", tmp_path / "o", "--step", 7)) == (
      f"step 7 is not in {ckpt_dir} (steps on disk: [1, 2]); pass one of them.")
  full = tmp_path / "full"
  full.mkdir()
  (full / "notes.txt").write_text("mine")
  assert _err(capsys, _cli("--workdir", run, "--out", full)) == (
      f"--out={full} already holds files; pass an empty or new directory, or --overwrite")
  assert (full / "notes.txt").read_text() == "mine"
  assert "--max-shard-size: size 'big'" in _err(
      capsys, _cli("--workdir", run, "--out", tmp_path / "o", "--max-shard-size", "big"))
  assert _err(capsys, _cli("--workdir", run, "--out", tmp_path / "o", "--critic")) == (
      f"checkpoint step 2 in {ckpt_dir} holds no critic/params (the run trained no critic).")
  assert not (tmp_path / "o").exists()  # nothing is written before every read succeeded
  assert "the following arguments are required: --out" in _err(capsys, _cli("--workdir", run))
  # another architecture: the run's model directory on this host is not the run's model
  other = tmp_path / "other"
  other.mkdir()
  hf_export.write_model_dir(str(other), TINY.replace(num_layers=3),
                            _random_params(TINY.replace(num_layers=3), seed=0),
                            tokenizer=tokenizer_lib.tiny_tokenizer())
  assert _err(capsys, _cli("--workdir", run, "--out", tmp_path / "o2", "--model-path", other)) == (
      f"checkpoint step 2 in {ckpt_dir} is not the architecture of {other}: layers/attn_norm "
      f"is (2, 64) there, (3, 64) in the model; pass the run's own --model-path")
  # a corrupt step: its array files truncated
  for root, _, files in os.walk(os.path.join(ckpt_dir, "2", "state")):
    for f in files:
      open(os.path.join(root, f), "w").close()
  message = _err(capsys, _cli("--workdir", run, "--out", tmp_path / "o3"))
  assert message.startswith(f"checkpoint step 2 in {ckpt_dir} is unreadable (")
  assert message.endswith("); pass an older --step ([1]).")


def test_module_entry_point_fails_in_one_line(tmp_path):
  """`python -m launch.export` as users run it: bad input is one line on stderr, exit 2,
  and nothing else (no accelerator start-up noise)."""
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  proc = subprocess.run([sys.executable, "-m", "launch.export", f"--workdir={tmp_path}",
                         f"--out={tmp_path}/o"], cwd=root, capture_output=True, text=True,
                        timeout=300, check=False)
  assert proc.returncode == 2 and proc.stdout == ""
  assert proc.stderr == (f"launch.export: error: {tmp_path} holds no checkpoint (no step folders "
                         f"in {tmp_path}/checkpoints or {tmp_path}); pass the workdir of a run "
                         "that saved one.\n")


@pytest.mark.slow
def test_smollm2_export_equals_transformers(tmp_path):
  """SmolLM2-135M-Instruct from its GGUF (interleaved RoPE, GGUF tokenizer) out as a
  Llama directory: transformers' logits and chat prompt ids equal the project's."""
  import torch
  import transformers
  model, tok, cfg = loading.load_model("smollm2-135m")
  params = jax.tree.map(np.asarray, export.flat_params(nnx.to_pure_dict(nnx.state(model, nnx.Param))))
  run = str(tmp_path / "run")
  _save_run(run, {4: params}, config={"model": {"name": "smollm2-135m", "path": ""}})
  out = tmp_path / "smollm2"
  assert _cli("--workdir", run, "--out", out) == 0
  hf = json.load(open(out / "config.json"))
  assert (hf["model_type"], hf["rope_parameters"]["rope_theta"], hf["tie_word_embeddings"]) == (
      "llama", 100000.0, True)
  messages = [{"role": "user", "content": "You are in a room. Go to the fridge 1."}]
  prompt = tok.apply_chat_template(messages)
  hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
  assert hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == prompt
  ids = tok.encode(prompt)
  assert hf_tok(prompt, add_special_tokens=False)["input_ids"] == ids
  tokens = np.asarray([ids], np.int32)
  positions = np.arange(len(ids), dtype=np.int32)[None]
  want = np.asarray(model(tokens, positions, np.ones(tokens.shape, bool))[0])
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
  with torch.no_grad():
    got = hf_model(input_ids=torch.tensor(tokens, dtype=torch.long)).logits.numpy()
  np.testing.assert_allclose(got, want, atol=1e-4 * np.abs(want).max(), rtol=0)


def test_run_of_a_model_directory_copies_its_tokenizer_and_generation_config(tmp_path, capsys):
  """A run that read a Hugging Face directory: the export takes its architecture from
  that directory's config.json and copies its tokenizer files and generation_config.json
  byte for byte; the directory lies elsewhere on this host: --model-path names it."""
  cfg = _variant("qwen2")
  base = tmp_path / "base"
  base.mkdir()
  hf_export.write_model_dir(str(base), cfg, _random_params(cfg, seed=10),
                            tokenizer=tokenizer_lib.tiny_tokenizer())
  (base / "generation_config.json").write_text('{"eos_token_id": [2, 0], "temperature": 0.7}\n')
  (base / "special_tokens_map.json").write_text('{"eos_token": "<|im_end|>"}\n')
  trained = _random_params(cfg, seed=11)
  moved = tmp_path / "moved"
  run = str(tmp_path / "run")
  _save_run(run, {1: trained}, config={"model": {"name": "qwen2.5-1.5b", "path": str(moved)}})
  out = tmp_path / "out"
  assert _err(capsys, _cli("--workdir", run, "--out", out)) == (
      f"the run's model directory {moved} (qwen2.5-1.5b) is not on "
      "this host; pass --model-path=DIR (its config.json and tokenizer)")
  assert _cli("--workdir", run, "--out", out, "--model-path", base) == 0
  for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
               "generation_config.json"):
    assert (out / name).read_bytes() == (base / name).read_bytes(), name
  assert json.load(open(out / "config.json"))["model_type"] == "qwen2"
  want = _project_logits(cfg, trained)
  np.testing.assert_allclose(_transformers_logits(str(out)), want,
                             atol=1e-5 * np.abs(want).max(), rtol=0)
