r"""Export a trained policy as a Hugging Face model directory.

  python -m launch.export --workdir=W --out=DIR [--step=N] [--dtype=bfloat16] \
      [--max-shard-size=5GB] [--critic] [--overwrite] [--model-path=HF_DIR] [--lora-adapter]

Reads the policy parameters of W's latest checkpoint step (or step N) on this host's CPU,
as numpy, without the training mesh or the optimizer state
(`hgpo_jax.training.checkpoint.read_params`): a checkpoint a pod wrote exports on a
workstation. It writes DIR as `hgpo_jax.models.hf_export.write_model_dir` lays it out:
config.json of the model's family (llama for the tiny preset and SmolLM2, qwen2, qwen3),
model.safetensors (or shards and model.safetensors.index.json above --max-shard-size),
generation_config.json and the tokenizer files (copied from the run's Hugging Face
directory; for the GGUF and tiny models, tokenizer.json and a tokenizer_config.json with
the chat template). `transformers.AutoModelForCausalLM.from_pretrained(DIR)` and this
project's `--config.model.path=DIR` load it. `--critic` also writes the value model to
DIR/critic (docs/architecture.md, "Ways out").

A LoRA run (`model.lora.rank` > 0) saves only its adapters: the export merges them into the
run's base model (W + s · (A B)ᵀ, `hgpo_jax.models.lora.merged_weight`) and writes the
merged full model, or with `--lora-adapter` writes DIR as a PEFT adapter directory
(adapter_config.json + adapter_model.safetensors, PEFT's key names) that
`peft.PeftModel.from_pretrained(base, DIR)` and this project's `--config.model.lora.path=DIR`
load onto the base. `--critic` of a LoRA run merges the critic's own adapters into the
base's backbone the same way (its value heads are full rank); `--lora-adapter --critic` is
refused (a PEFT adapter holds no value heads).

The run's model comes from the config saved with the checkpoint (`model.name`,
`model.path`); a run that loaded a Hugging Face directory needs it on this host for the
architecture and tokenizer (`--model-path` names it when it lies elsewhere here).
Bad input (no checkpoint, a missing step, an unreadable step, an output directory that
holds files, a model directory of another architecture) ends with one line,
`launch.export: error: ...`, and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

PROG = "launch.export"
EXIT_BAD_INPUT = 2
DTYPES = ("float32", "bfloat16")


class ExportError(Exception):
  """Bad input to the export: one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
  """argparse with its errors as one line (`launch.export: error: ...`), exit status 2."""

  def error(self, message):
    raise ExportError(message)


def parse_args(argv: list[str]) -> argparse.Namespace:
  ap = _Parser(prog=PROG, description=__doc__.splitlines()[0], epilog=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--workdir", required=True,
                  help="a training workdir (its checkpoints/), or a checkpoint directory")
  ap.add_argument("--out", required=True, help="the directory to write")
  ap.add_argument("--step", type=int, default=None, help="the step to export (default: latest)")
  ap.add_argument("--dtype", choices=DTYPES, default=None,
                  help="dtype of the written tensors (default: as saved)")
  ap.add_argument("--max-shard-size", default="5GB",
                  help="largest model.safetensors file before sharding, e.g. 5GB, 500MB, 2MiB")
  ap.add_argument("--critic", action="store_true",
                  help="also write the value model to OUT/critic (critic estimators' runs)")
  ap.add_argument("--lora-adapter", action="store_true",
                  help="a LoRA run's adapters as a PEFT adapter directory (default: the "
                       "adapters merged into the full model)")
  ap.add_argument("--overwrite", action="store_true",
                  help="write into an OUT that already holds files (replacing the export's files)")
  ap.add_argument("--model-path", default="",
                  help="the run's Hugging Face model directory on this host, if not at the "
                       "saved config's model.path")
  return ap.parse_args(argv)


def _check_output(out: str, overwrite: bool) -> None:
  """Fails early (before any reading) on an --out that is a file, or that holds files
  without --overwrite."""
  if os.path.exists(out) and not os.path.isdir(out):
    raise ExportError(f"--out={out} is a file; pass a directory")
  if os.path.isdir(out) and os.listdir(out) and not overwrite:
    raise ExportError(f"--out={out} already holds files; pass an empty or new directory, or "
                      "--overwrite")


def _prepare_output(out: str) -> None:
  """Creates `out`, removing what a previous export there wrote that this one may not
  (shards of another count, another tokenizer's files, a value model); other files stay."""
  from hgpo_jax.models import hf_export
  if os.path.isdir(out):
    for name in os.listdir(out):
      path = os.path.join(out, name)
      if (name.startswith("model") and ".safetensors" in name) or name in (
          hf_export.TOKENIZER_FILES + (hf_export.VALUE_HEADS_FILE, hf_export.VALUE_HEADS_JSON)):
        os.remove(path)
      elif name == "critic" and os.path.isfile(os.path.join(path, hf_export.VALUE_HEADS_JSON)):
        shutil.rmtree(path)
  try:
    os.makedirs(out, exist_ok=True)
  except OSError as e:
    raise ExportError(f"--out={out} cannot be created ({e.strerror or e})") from None


def run_model(model: dict, model_path: str = ""):
  """(ModelConfig, Tokenizer, HF directory or None) of a run's `config.model` (JSON), as
  the trainer resolves it (`hgpo_jax.training.run._load_policy`), without its weights."""
  from hgpo_jax.models import loading
  name, path = model.get("name", ""), model_path or model.get("path") or ""
  source = name if name in loading.PRESETS_WITH_PATH or not path else path
  try:
    return _run_model(source, name, path)
  except (ValueError, OSError) as e:  # the model readers' one-line errors
    raise ExportError(f"the run's model {source}: {e}") from None


def _run_model(source: str, name: str, path: str):
  from hgpo_jax.models import config as model_config
  from hgpo_jax.models import gguf_file
  from hgpo_jax.models import loading
  from hgpo_jax.models import tokenizer as tokenizer_lib
  if source == "tiny":
    return model_config.get_preset("tiny"), tokenizer_lib.tiny_tokenizer(), None
  if source == "smollm2-135m" or source.endswith(".gguf"):
    gguf = gguf_file.GGUFFile(loading.smollm2_gguf_path() if source == "smollm2-135m" else source)
    return gguf.model_config(), gguf.tokenizer(), None
  # a run of an HF directory named as `model.name` (the trainer loads it from there)
  directory = path or (source if os.path.isdir(source) else os.environ.get(loading.MODEL_PATH_ENV, ""))
  if not os.path.isdir(directory):
    raise ExportError(f"the run's model directory {directory or '(none)'} ({name}) is not on "
                      "this host; pass --model-path=DIR (its config.json and tokenizer)")
  return (model_config.read_hf_config(directory), tokenizer_lib.Tokenizer.from_hf_dir(directory),
          directory)


def flat_params(tree: dict, prefix: str = "") -> dict:
  """{"embed": a, "layers": {"q": b}} -> {"embed": a, "layers/q": b} (the Decoder's
  parameter paths, as `loading.model_from_params` and `weights.hf_tensors` name them)."""
  out = {}
  for key, value in tree.items():
    if isinstance(value, dict):
      out.update(flat_params(value, f"{prefix}{key}/"))
    else:
      out[f"{prefix}{key}"] = value
  return out


def _check_architecture(cfg, params: dict, where: str, model_name: str) -> None:
  """ExportError naming the first parameter whose shape is not the architecture's."""
  from flax import nnx
  from hgpo_jax.models import decoder
  abstract = nnx.eval_shape(lambda: decoder.Decoder(cfg, rngs=nnx.Rngs(0)))
  want = flat_params(nnx.to_pure_dict(nnx.state(abstract, nnx.Param)))
  for name in sorted(set(want) | set(params)):
    have_shape = tuple(params[name].shape) if name in params else "absent"
    want_shape = tuple(want[name].shape) if name in want else "absent"
    if have_shape != want_shape:
      raise ExportError(f"{where} is not the architecture of {model_name}: {name} is "
                        f"{have_shape} there, {want_shape} in the model; pass the run's own "
                        "--model-path")


def _run_lora(model: dict, params: dict, where: str, num_layers: int):
  """The LoraConfig of a run's `config.model` (JSON) over a `num_layers`-layer base: its
  starting adapter's (`model.lora.path`) or its `model.lora` keys; ExportError when
  `params` hold no adapters."""
  from hgpo_jax.models import lora as lora_lib
  if not lora_lib.has_adapters(params):
    raise ExportError(f"--lora-adapter: {where} holds no LoRA adapters (the run trained the "
                      "full model; export it without --lora-adapter)")
  section = model.get("lora") or {}
  try:
    if section.get("path"):
      return lora_lib.read_peft_config(section["path"], num_layers)
    return lora_lib.from_settings(section["rank"], section["alpha"], section["targets"],
                                  section.get("rslora", False), section.get("top_layers", 0))
  except (ValueError, OSError, KeyError) as e:
    raise ExportError(f"the run's model.lora: {e}") from None


def _base_params(model: dict, model_path: str, seed: int) -> dict:
  """The run's base model as the trainer loads it (float32, on the host): pure params."""
  from flax import nnx
  from hgpo_jax.models import loading
  name, path = model.get("name", ""), model_path or model.get("path") or ""
  source = name if name in loading.PRESETS_WITH_PATH or not path else path
  try:
    base, _, _ = loading.load_model(source, path=path or None, seed=seed)
  except (ValueError, OSError) as e:
    raise ExportError(f"the run's base model {source}: {e}") from None
  return nnx.to_pure_dict(nnx.state(base, nnx.Param))


def _merged(base: dict, lora, adapters: dict) -> dict:
  """`base` (pure params; the critic's backbone keys or the whole decoder) with the
  `adapters` (a LoRA checkpoint's tree of the same layout) merged into its weights
  (`lora.merge_into_base`): pure params as numpy."""
  import jax
  import numpy as np
  from hgpo_jax.models import lora as lora_lib
  full = dict(base, layers={**base["layers"], **adapters["layers"]})
  return jax.tree.map(np.asarray, lora_lib.merge_into_base(full, lora, np.float32))


def export(args: argparse.Namespace) -> list[str]:
  """Writes the export; returns the paths written (relative to --out)."""
  from hgpo_jax.models import critic as critic_lib
  from hgpo_jax.models import hf_export
  from hgpo_jax.models import lora as lora_lib
  from hgpo_jax.models import value_heads
  from hgpo_jax.training import checkpoint as checkpoint_lib

  try:
    max_shard_bytes = hf_export.parse_size(args.max_shard_size)
  except ValueError as e:
    raise ExportError(f"--max-shard-size: {e}") from None
  directory, step = checkpoint_lib.resolve_step(args.workdir, args.step)
  _check_output(args.out, args.overwrite)
  print(f"{PROG}: step {step} of {directory} -> {args.out}", flush=True)
  host = checkpoint_lib.read_params(directory, step)
  model = host.config.get("model", {})
  cfg, tokenizer, tokenizer_dir = run_model(model, args.model_path)
  model_name = args.model_path or model.get("path") or model.get("name", "?")
  policy = host.params
  lora = base = None
  if args.lora_adapter or lora_lib.has_adapters(host.params):
    lora = _run_lora(model, host.params, f"checkpoint step {step} in {directory}",
                     cfg.num_layers)
    if args.lora_adapter:
      if args.critic:
        raise ExportError("--lora-adapter writes the policy's adapters only; export the "
                          "value model (--critic) without --lora-adapter, as a merged model")
      _prepare_output(args.out)
      lora_lib.write_peft_adapter(args.out, lora, host.params["layers"],
                                  num_layers=cfg.num_layers, base_model=model_name)
      return [lora_lib.CONFIG_FILE, lora_lib.WEIGHTS_FILE]
    base = _base_params(model, args.model_path, host.config.get("seed", 0))
    policy = _merged(base, lora, host.params)
  params = flat_params(policy)
  saved_dtype = str(next(iter(params.values())).dtype)
  cfg = cfg.replace(dtype=saved_dtype, param_dtype=saved_dtype)
  where = f"checkpoint step {step} in {directory}"
  _check_architecture(cfg, params, where, model_name)
  if args.critic:  # read and checked before anything is written
    critic = checkpoint_lib.read_params(directory, step, subtree=checkpoint_lib.CRITIC).params
    heads = value_heads.LEVELS.get(int(critic["value_head"].shape[0]))
    backbone = critic["backbone"]
    if lora is not None:
      # A LoRA run's critic saves its backbone's adapters (and its full-rank heads): its
      # backbone is the base's (`critic.params_from_policy`) with them merged.
      if not lora_lib.has_adapters(backbone):
        raise ExportError(f"{where}: the policy has LoRA adapters but the critic's backbone "
                          "has none (a checkpoint of two different runs?)")
      backbone = _merged({k: base[k] for k in critic_lib.BACKBONE_KEYS}, lora, backbone)
    backbone = flat_params(backbone)
    _check_architecture(critic_lib.backbone_config(cfg), backbone, where + " (critic)", model_name)
  _prepare_output(args.out)
  common = dict(tokenizer=tokenizer, tokenizer_dir=tokenizer_dir, dtype=args.dtype,
                max_shard_bytes=max_shard_bytes)
  files = hf_export.write_model_dir(args.out, cfg, params, **common)
  if args.critic:
    critic_dir = os.path.join(args.out, "critic")
    _prepare_output(critic_dir)
    files += [os.path.join("critic", f) for f in hf_export.write_critic_dir(
        critic_dir, cfg, backbone, critic["value_head"], critic["value_bias"], heads, **common)]
  return files


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  if "jax" not in sys.modules:
    # The export reads checkpoints on the host: no accelerator is started (one a training
    # job holds would refuse a second process).
    os.environ["JAX_PLATFORMS"] = "cpu"
  try:
    args = parse_args(argv)
    files = export(args)
  except Exception as e:
    from hgpo_jax.training import checkpoint as checkpoint_lib
    # Bad input: the arguments, the checkpoint, the run's model files; anything else is a
    # bug: traceback.
    if not isinstance(e, (ExportError, checkpoint_lib.CheckpointError)):
      raise
    line = " ".join(str(e).split())
    print(f"{PROG}: error: {line}", file=sys.stderr, flush=True)
    return EXIT_BAD_INPUT
  size = sum(os.path.getsize(os.path.join(args.out, f)) for f in files)
  print(f"{PROG}: wrote {len(files)} files, {size / 2**20:.1f} MiB, to {args.out}", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
