"""The bad-input matrix over every public surface: each case with the message it gives.

* `launch.main`: one line `launch.main: error: ...` naming the fix, exit code 2, no
  traceback (`--verbose` adds it);
* the advantage CLI: rollout dumps with missing fields, NaN rewards, duplicate steps;
* env servers: malformed protobufs, unknown slots, empty / 1 MB / non-UTF-8 /
  control-character actions, oversized messages: a clear status, and the other slots
  keep being served exactly as an undisturbed env;
* model outputs through the ALFWorld/WebShop action projection and the HiPER parser;
* weight files: truncated safetensors, a GGUF of an unsupported architecture, a
  config.json with missing fields.
Plus property-based fuzzing (hypothesis, fixed example budget, derandomized) of the
action projection, the HiPER parser and token tags, and the server's request handling.
"""

import json
import os
import pathlib
import subprocess
import sys

import grpc
import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

from env_servers import serve
from env_servers.protos import env_pb2
from env_servers.protos import env_pb2_grpc
from env_servers.sokoban import env as sokoban
from hgpo_jax.advantages import __main__ as advantage_cli
from hgpo_jax.advantages import hae
from hgpo_jax.rollout import projection

ROOT = pathlib.Path(__file__).resolve().parent.parent
FUZZ = hypothesis.settings(max_examples=50, derandomize=True, deadline=None,
                           database=None, suppress_health_check=list(hypothesis.HealthCheck))


# ----------------------------------------------------------------------------- launch.main
def _launch(tmp_path, *args, tool="launch.main"):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", tool, *args], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=300, check=False)
  return proc.returncode, proc.stderr


def _hf_dir(path: pathlib.Path, config: dict) -> str:
  path.mkdir()
  (path / "config.json").write_text(json.dumps(config))
  return str(path)


_SMOKE = "--config=configs/sokoban.py:smoke"
_LLAMA = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=96,
              num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
              tie_word_embeddings=True)

LAUNCH_CASES = {
    "unknown config argument": (
        [f"{_SMOKE},colour=red"],
        "unknown config argument 'colour'; known: ['algo', 'boxes', 'dim', 'dynamic', 'gspo', "
        "'k', 'levels', 'model', 'smoke']; fix the --config=FILE:ARGS string"),
    "mistyped override": (
        [_SMOKE, "--config.train.lrr=0.1"],
        "unknown config field --config.train.lrr; did you mean --config.train.lr"),
    "mistyped section": (
        [_SMOKE, "--config.envv.max_steps=3"],
        "unknown config field --config.envv.max_steps; did you mean --config.env.max_steps"),
    "ill-typed override": (
        [_SMOKE, "--config.train.lr=fast"],
        "flag --config.train.lr=fast: could not convert string to float: 'fast'; give the "
        "override a value of the field's type"),
    "unknown estimator": (
        [f"{_SMOKE},algo=nope"],
        "unknown advantage estimator 'nope'; registered: ['gae', 'gigpo', 'grpo', 'hae', "
        "'hgpo', 'rloo']"),
    "unknown estimator override": (
        [_SMOKE, "--config.algo.name=ppo"], "unknown advantage estimator 'ppo'"),
    "unknown policy loss": (
        [_SMOKE, "--config.train.policy_loss=dpo"],
        "config.train: policy_loss='dpo': unknown policy loss 'dpo'; registered: ['gspo', 'ppo']"),
    "unknown metric writer": (
        [_SMOKE, "--config.metrics.writers=('tensorboard','mlflow')"],
        "config.metrics.writers: unknown metric writer 'mlflow'; registered: ['jsonl', "
        "'tensorboard', 'wandb']"),
    "missing config file": (
        ["--config=configs/sokobann.py:smoke"],
        "config file could not be loaded (No such file or directory: 'configs/sokobann.py'); "
        "pass --config=configs/<env>.py[:args]"),
    "missing model path": (
        [_SMOKE, "--config.model.name=qwen2.5-1.5b"],
        "qwen2.5-1.5b has no bundled weights: pass load_model(..., path=DIR) or set "
        "HGPO_JAX_MODEL_PATH to a local Hugging Face directory of the checkpoint. From the "
        "command line: --config.model.path=DIR."),
    "model path that does not exist": (
        [_SMOKE, "--config.model.name=qwen2.5-1.5b", "--config.model.path=/nonexistent/qwen"],
        "/nonexistent/qwen (weights of qwen2.5-1.5b) is not a directory."),
    "weights of the wrong architecture": (
        [_SMOKE, "--config.model.path={gemma}"],
        "{gemma}/config.json: model_type='gemma3' is not supported; supported: ('llama', "
        "'qwen2', 'qwen3')."),
    "unwritable workdir": (
        [_SMOKE], "workdir {file}/run is not writable (Not a directory); pass a --workdir you "
        "can write to"),
    "stray argument": (
        [_SMOKE, "extra"], "unexpected arguments: ['extra']"),
    "unknown compute dtype": (
        [_SMOKE, "--config.model.compute_dtype=fp8"],
        "config.model.compute_dtype='fp8': use one of ('auto', '', 'float32', 'bfloat16') "
        "(auto: bfloat16 on TPU/GPU, model.dtype on CPU; \"\": model.dtype)"),
    "negative attention chunk": (
        [_SMOKE, "--config.model.attn_query_chunk=-1"],
        "config.model.attn_query_chunk=-1 must be >= 0 (0: off)"),
    "adapters on more layers than the model has": (
        [_SMOKE, "--config.model.lora.rank=4", "--config.model.lora.top_layers=5"],
        "config.model.lora.top_layers=5 exceeds the model's 2 layers."),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(LAUNCH_CASES))
def test_launch_main_bad_input_is_one_line_and_exit_2(tmp_path, case):
  args, message = LAUNCH_CASES[case]
  gemma = _hf_dir(tmp_path / "gemma", {"model_type": "gemma3"})
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  workdir = str(blocker / "run") if case == "unwritable workdir" else str(tmp_path / "run")
  args = [a.format(gemma=gemma) for a in args]
  code, err = _launch(tmp_path, *args, f"--workdir={workdir}")
  message = message.format(file=blocker, gemma=gemma)
  assert code == 2, err
  assert err.endswith(" (--verbose prints the traceback)\n"), err
  assert err.count("\n") == 1 and "Traceback" not in err, err
  assert err.startswith("launch.main: error: " + message), err


@pytest.mark.slow
def test_launch_main_verbose_shows_the_traceback(tmp_path):
  code, err = _launch(tmp_path, f"{_SMOKE},algo=nope", f"--workdir={tmp_path}", "--verbose")
  assert code == 2 and "Traceback (most recent call last)" in err
  assert err.splitlines()[-1] == ("launch.main: error: unknown advantage estimator 'nope'; "
                                  "registered: ['gae', 'gigpo', 'grpo', 'hae', 'hgpo', 'rloo']")


# The evaluation entry point shares launch.main's flags and guard (`run_guarded`): the
# same one line, under its own name.
EVALUATE_CASES = {
    "no workdir": (
        [_SMOKE], "flag --workdir=None: Flag --workdir must have a value other than None."),
    "missing config file": (
        ["--config=configs/sokobann.py:smoke", "--workdir={tmp}/run"],
        "config file could not be loaded (No such file or directory: 'configs/sokobann.py'); "
        "pass --config=configs/<env>.py[:args] (run from the repository root)"),
    "mistyped override": (
        [_SMOKE, "--workdir={tmp}/run", "--config.eval.num_taskss=2"],
        "unknown config field --config.eval.num_taskss; did you mean --config.eval.num_tasks "
        "or --config.env.num_servers?"),
    "nothing to evaluate": (
        [_SMOKE, "--workdir={tmp}/run", "--config.env.eval_splits=()"],
        "config.env.eval_splits is empty: nothing to evaluate"),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(EVALUATE_CASES))
def test_launch_evaluate_bad_input_is_one_line_and_exit_2(tmp_path, case):
  args, message = EVALUATE_CASES[case]
  code, err = _launch(tmp_path, *[a.format(tmp=tmp_path) for a in args], tool="launch.evaluate")
  assert code == 2, err
  assert err.count("\n") == 1 and "Traceback" not in err, err
  assert err == f"launch.evaluate: error: {message} (--verbose prints the traceback)\n", err


# --------------------------------------------------------------------------- advantage CLI
_ROW = {"group": "g", "traj": "t", "step": 0, "anchor_obs": "A", "reward": 0.0, "valid": True}

DUMP_CASES = {
    "missing field": ([{k: v for k, v in _ROW.items() if k != "reward"}],
                      "{path}:1: malformed row: missing field 'reward'"),
    "NaN reward": ([dict(_ROW, reward=float("nan"))],
                   "{path}:1: malformed row: field 'reward' is nan, expected a finite number"),
    "duplicate step": ([_ROW, dict(_ROW, anchor_obs="B")],
                       "trajectory 't' has step 0 twice; (traj, step) must be unique"),
    "gap in steps": ([_ROW, dict(_ROW, step=2)],
                     "trajectory 't' has step 2 where step 1 was expected"),
}


@pytest.mark.parametrize("case", sorted(DUMP_CASES))
def test_advantage_cli_bad_dumps(tmp_path, capsys, case):
  rows, message = DUMP_CASES[case]
  path = tmp_path / "dump.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  assert advantage_cli.main([str(path), "--estimator", "grpo"]) == 2
  out = capsys.readouterr()
  assert out.out == "" and out.err.count("\n") == 1
  assert out.err.startswith("error: " + message.format(path=path)), out.err


# ----------------------------------------------------------------------------- env servers
SLOTS = 4
TASK = "train-00005"


@pytest.fixture(name="server", scope="module")
def fixture_server():
  """An in-process server (2 MiB message cap) and its stub; slot 3 is a witness that is
  stepped only with good actions and must stay equal to an undisturbed env."""
  core = serve.SlotServer("sokoban", SLOTS)
  grpc_server, port, _ = serve.make_grpc_server(core, "127.0.0.1", 0, 4, 2 * 2**20)
  channel = grpc.insecure_channel(f"127.0.0.1:{port}",
                                  options=[("grpc.max_send_message_length", 64 * 2**20)])
  stub = env_pb2_grpc.EnvStub(channel)
  yield stub, channel
  channel.close()
  grpc_server.stop(None)


class _Witness:
  """Slot 3 on the server next to an in-process env; `check` steps both and compares."""

  def __init__(self, stub):
    self.stub, self.env = stub, sokoban.SokobanEnv()
    self.env.reset(seed=0, options={"task_id": TASK, "split": "train"})
    stub.Reset(env_pb2.ResetRequest(slots=[3], task_ids=[TASK], seeds=[0], split="train"),
               timeout=10)
    self.moves = iter(["left", "up", "right", "down"] * 10)  # never ends train-00005

  def check(self):
    move = next(self.moves)
    obs, reward, done, _, _ = self.env.step(move)
    r = self.stub.Step(env_pb2.StepRequest(slots=[3], actions=[move.encode()]),
                       timeout=10).results[0]
    assert (r.observation, r.reward, r.done) == (obs, reward, done)


def _status(call):
  try:
    call()
  except grpc.RpcError as e:
    return e.code(), e.details()
  return grpc.StatusCode.OK, ""


IA = grpc.StatusCode.INVALID_ARGUMENT
FP = grpc.StatusCode.FAILED_PRECONDITION


def test_env_server_bad_requests_get_a_status_and_other_slots_keep_going(server):
  stub, channel = server
  witness = _Witness(stub)
  stub.Reset(env_pb2.ResetRequest(slots=[0], task_ids=[TASK], seeds=[0], split="train"),
             timeout=10)
  raw_step = channel.unary_unary("/hgpo_jax.env.v1.Env/Step")
  raw_reset = channel.unary_unary("/hgpo_jax.env.v1.Env/Reset")

  def step(slots, actions):
    return lambda: stub.Step(env_pb2.StepRequest(slots=slots, actions=actions), timeout=10)

  cases = [
      (lambda: raw_step(b"\x0a\xff\xff", timeout=10), IA, "malformed StepRequest: Error parsing"),
      (lambda: raw_reset(b"\x22\x02\xc3\x28", timeout=10), IA, "malformed ResetRequest:"),
      (step([9], [b"up"]), IA, "slot 9: unknown slot; this server has slots 0..3"),
      (step([1], [b"up"]), FP, "slot 1: step before reset; call Reset on it first"),
      (step([0], [b"\xc3\x28"]), IA, "slot 0: action is not valid UTF-8 (invalid continuation "
                                     "byte at byte 0); send UTF-8 text"),
      (step([0], [b"u" * (3 * 2**20)]), grpc.StatusCode.RESOURCE_EXHAUSTED, "SERVER: Received message "
                                                                         "larger than max"),
      (lambda: stub.Reset(env_pb2.ResetRequest(slots=[1], task_ids=["train-99999"], seeds=[0],
                                               split="train"), timeout=10),
       IA, "slot 1: unknown task id 'train-99999' in split 'train'"),
  ]
  for call, code, message in cases:
    got = _status(call)
    assert got[0] == code and got[1].startswith(message), got
    witness.check()
  # Actions the env sees as (invalid) moves: the slot goes on, nothing is an error.
  for action, shown in [(b"", "''"), (b"x" * 2**20, "'xxxx"), ("up\x00\x1b[2J\r\n\t".encode(),
                                                                 "'up\\x00\\x1b[2J\\r\\n\\t'")]:
    r = stub.Step(env_pb2.StepRequest(slots=[0], actions=[action]), timeout=10).results[0]
    assert r.observation.startswith(f"Invalid action {shown}") and not r.done, r.observation
    assert "error" not in r.info
    witness.check()


# -------------------------------------------------------------- model outputs (projection)
PROJECTION_CASES = [
    # (response, fallback_chars, require_think) -> (action, valid)
    ("", 30, True, ("", False)),
    ("   \n\t ", 30, True, ("   \n\t ", False)),
    ("go to desk 1", 30, True, ("go to desk 1", False)),  # no tags: last 30 chars
    ("<think>x</think> I will now go to the kitchen counter 1", 20, True,
     ("he kitchen counter 1", False)),  # WebShop's 20-char fallback
    # truncated mid-tag: the last 30 characters
    ("<think>x</think><action>go to desk", 30, True, ("nk>x</think><action>go to desk", False)),
    ("<think>x</think><action>go to desk 1</act", 30, True, ("hink><action>go to desk 1</act",
                                                            False)),
    ("<think>x</think><acti", 30, True, ("<think>x</think><acti", False)),
    ("<think>x</think><action>take mug</action><action>go north</action>", 30, True,
     ("take mug", True)),  # repeated tags: the first pair
    ("<think>x</think></action>go north<action>", 30, True,  # wrong order: no closing tag
     ("hink></action>go north<action>", False)),  # after the opening one
    ("<action>open drawer 2</action><think>why</think>", 30, True, ("open drawer 2", True)),
    ("<action>open drawer 2</action>", 30, True, ("open drawer 2", False)),  # no think
    ("<action>open drawer 2</action>", 30, False, ("open drawer 2", True)),  # constrained
    ("<think></think><action>  \n </action>", 30, True, ("", True)),  # empty action, valid format
    ("<THINK>a</THINK><ACTION>Go To Desk 1</ACTION>", 30, True, ("go to desk 1", True)),
    ("<think>好</think><action>go</action>", 30, True, ("go", False)),  # CJK
]


@pytest.mark.parametrize("response,fallback,require_think,expected", PROJECTION_CASES)
def test_projection_of_malformed_model_outputs(response, fallback, require_think, expected):
  assert projection.project_action(response, fallback, require_think) == expected


_TAGS = st.sampled_from(["<think>", "</think>", "<action>", "</action>", "<ACTION>", " ", "\n",
                         "go to desk 1", "好", "<act", "ion>", "x" * 40])


@FUZZ
@hypothesis.given(st.lists(st.one_of(_TAGS, st.text(max_size=20)), max_size=12),
                  st.integers(1, 50), st.booleans())
def test_projection_fuzz(parts, fallback, require_think):
  response = "".join(parts)
  action, valid = projection.project_action(response, fallback, require_think)
  text = response.lower()
  assert isinstance(action, str) and action in text  # always a piece of the response
  start = text.find("<action>")
  end = text.find("</action>", start + 8) if start >= 0 else -1
  if start == -1 or end == -1:
    assert (action, valid) == (text[-fallback:], False)
  else:
    assert action == text[start + 8:end].strip()
    assert valid == ((not require_think or ("<think>" in text and "</think>" in text))
                     and not projection._CJK.search(text))


# HiPER's three-block format (hgpo_jax/rollout/hiper.py): (action, valid, switch, subgoal).
_H = "<switch>KEEP</switch><subgoal>find the mug</subgoal><action>go to desk 1</action>"
HIPER_CASES = [
    ("", ("", False, None, None)),
    ("  \n\t", ("  \n\t", False, None, None)),
    ("go to desk 1", ("go to desk 1", False, None, None)),  # no tags
    (_H, ("go to desk 1", True, "KEEP", "find the mug")),
    (_H[:40], (_H[:40].lower()[-30:], False, "KEEP", None)),  # truncated mid-subgoal
    (_H[:-4], (_H[:-4].lower()[-30:], False, "KEEP", "find the mug")),  # mid closing tag
    ("<switch>SWITCH</switch><switch>KEEP</switch><subgoal>a</subgoal><subgoal>b</subgoal>"
     "<action>x</action><action>y</action>", ("x", True, "SWITCH", "a")),  # repeated: first
    ("<action>Take Mug</action><subgoal> get mug </subgoal><switch> keep </switch>",
     ("take mug", True, "KEEP", "get mug")),  # any order; switch stripped and upper-cased
    ("<switch>MAYBE</switch><subgoal>a</subgoal><action>x</action>",
     ("x", False, "MAYBE", "a")),  # switch content other than KEEP/SWITCH
    ("</switch>KEEP<switch><subgoal>a</subgoal><action>x</action>",
     ("x", False, None, "a")),  # closing tag before the opening one
    ("<switch>KEEP</switch><subgoal></subgoal><action></action>", ("", True, "KEEP", "")),
]


@pytest.mark.parametrize("response,expected", HIPER_CASES)
def test_hiper_parser_on_malformed_outputs(response, expected):
  from hgpo_jax.rollout import hiper
  p = hiper.parse_response(response, 30)
  assert (p.action, p.valid, p.switch, p.subgoal) == expected


_HIPER_PARTS = st.sampled_from(["<switch>", "</switch>", "<subgoal>", "</subgoal>", "<action>",
                                "</action>", "KEEP", "SWITCH", "keep", " ", "\n", "take mug",
                                "<sub", "goal>", "好"])


@FUZZ
@hypothesis.given(st.lists(st.one_of(_HIPER_PARTS, st.text(max_size=8)), max_size=14),
                  st.lists(st.integers(1, 6), min_size=1, max_size=40))
def test_hiper_parser_and_token_tags_fuzz(parts, cuts):
  from hgpo_jax.rollout import hiper
  response = "".join(parts)
  p = hiper.parse_response(response, 30)
  action, valid = projection.project_action(response, 30, require_think=False)
  assert p.action == action
  assert p.valid == (valid and p.switch in ("KEEP", "SWITCH") and p.subgoal is not None)
  # Token tags for an arbitrary split of the response into "tokens": one tag per token,
  # and a token whose first character lies inside a complete block is in that block.
  pieces, pos = [], 0
  for n in cuts:
    if pos >= len(response):
      break
    pieces.append(response[pos:pos + n])
    pos += n
  if pos < len(response):
    pieces.append(response[pos:])
  tags = hiper.token_tags(pieces)
  assert len(tags) == len(pieces)
  spans = hiper.block_spans(response)
  start = 0
  for piece, tag in zip(pieces, tags):
    inside = [t for lo, hi, t in spans if lo <= start < hi]
    if inside:
      assert hae.tag_in(np.array([tag]), inside[0])[0]
    start += len(piece)


# ----------------------------------------------------------- server request handling fuzz
_OK = grpc.StatusCode.OK


@FUZZ
@hypothesis.given(st.lists(st.integers(-2, SLOTS + 1), max_size=5),
                  st.lists(st.one_of(st.binary(max_size=24),
                                     st.sampled_from([b"up", b"down", b"left", b"right"])),
                           max_size=5))
def test_server_step_fuzz(server, slots, actions):
  stub, _ = server
  stub.Reset(env_pb2.ResetRequest(slots=[0, 1, 2], task_ids=[TASK] * 3, seeds=[0] * 3,
                                  split="train"), timeout=10)
  code, details = _status(lambda: stub.Step(env_pb2.StepRequest(slots=slots, actions=actions),
                                            timeout=10))
  good = (len(slots) == len(actions) and len(set(slots)) == len(slots)
          and all(0 <= s <= 2 for s in slots))
  utf8 = all(_decodes(a) for a in actions)
  if good and utf8:
    assert code == _OK, details
  else:
    assert code in (IA, FP) and details.startswith(("slot ", f"{len(slots)} slots")), details


@FUZZ
@hypothesis.given(st.sampled_from(["Reset", "Step", "ListTasks", "Describe", "Close"]),
                  st.binary(max_size=64))
def test_server_raw_bytes_fuzz(server, method, payload):
  stub, channel = server
  call = channel.unary_unary(f"/hgpo_jax.env.v1.Env/{method}")
  code, details = _status(lambda: call(payload, timeout=10))
  # Never UNKNOWN/INTERNAL: garbage is INVALID_ARGUMENT, a parsable request is served or
  # rejected for a reason that names what is wrong.
  assert code in (_OK, IA, FP), (code, details)
  if code == IA and details.startswith("malformed"):
    assert details.endswith("use the env_servers.protos stubs")
  assert stub.Describe(env_pb2.DescribeRequest(), timeout=10).num_slots == SLOTS


def _decodes(raw: bytes) -> bool:
  try:
    raw.decode("utf-8")
  except UnicodeDecodeError:
    return False
  return True


# ------------------------------------------------------------------------------ weight files
def test_weight_files(tmp_path):
  from safetensors.numpy import save_file
  import gguf
  from hgpo_jax.models import load_model
  from hgpo_jax.models.tokenizer import tiny_tokenizer

  # Truncated safetensors: one line that says to download again.
  model_dir = _hf_dir(tmp_path / "llama", _LLAMA)
  tiny_tokenizer().backend.save(os.path.join(model_dir, "tokenizer.json"))
  weights = os.path.join(model_dir, "model.safetensors")
  save_file({"model.embed_tokens.weight": np.zeros((512, 64), np.float32)}, weights)
  data = pathlib.Path(weights).read_bytes()
  pathlib.Path(weights).write_bytes(data[:len(data) // 3])
  with pytest.raises(ValueError, match="model.safetensors: not a readable safetensors file") as e:
    load_model(model_dir)
  assert "download it again" in str(e.value) and "\n" not in str(e.value)

  # config.json with a missing field.
  broken = dict(_LLAMA)
  del broken["hidden_size"]
  (tmp_path / "llama" / "config.json").write_text(json.dumps(broken))
  with pytest.raises(ValueError, match=r"config.json: missing key 'hidden_size' of a llama config"):
    load_model(model_dir)

  # A GGUF of an architecture the decoder does not implement; a truncated GGUF.
  path = str(tmp_path / "gemma.gguf")
  writer = gguf.GGUFWriter(path, "gemma")
  writer.add_block_count(1)
  writer.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
  with pytest.raises(ValueError, match=r"gemma.gguf: GGUF architecture 'gemma' is not supported"):
    load_model(path)
  pathlib.Path(path).write_bytes(pathlib.Path(path).read_bytes()[:40])
  with pytest.raises(ValueError, match=r"gemma.gguf: not a readable GGUF file"):
    load_model(path)
