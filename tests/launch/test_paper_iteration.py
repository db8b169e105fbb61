"""`python -m launch.benchmarks.paper_iteration`: the paper-shaped iteration benchmark
(launch/benchmarks/paper_iteration.py): its fixed response lengths, its CPU refusal, and a
tiny CPU run whose printed numbers are recomputed from their own fields."""

import os
import re
import statistics
import subprocess
import sys

import numpy as np
import pytest

from hgpo_jax.models import loading
from hgpo_jax.sampling import constrained
from launch.benchmarks import paper_iteration

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bench(*args, timeout=1500):
  return subprocess.run([sys.executable, "-m", "launch.benchmarks.paper_iteration",
                         *args], cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"),
                        capture_output=True, text=True, timeout=timeout)


def test_lengths_parse_and_draw_within_bounds():
  rng = np.random.default_rng(0)
  assert paper_iteration.Lengths.parse("fixed:176").draw(rng, 1, 512) == 176
  assert paper_iteration.Lengths.parse("fixed:900").draw(rng, 1, 512) == 512  # clipped
  normal = paper_iteration.Lengths.parse("normal:176:64")
  draws = [normal.draw(rng, 1, 512) for _ in range(4000)]
  assert 1 <= min(draws) and max(draws) <= 512
  assert abs(statistics.fmean(draws) - 176) < 4 and abs(statistics.pstdev(draws) - 64) < 4
  uniform = [paper_iteration.Lengths.parse("uniform:10:20").draw(rng, 1, 512) for _ in range(500)]
  assert min(uniform) == 10 and max(uniform) == 20
  for bad in ("normal:176", "fixed:x", "poisson:3", "uniform:5:2", "fixed:-1"):
    with pytest.raises(ValueError, match="--response-lengths"):
      paper_iteration.Lengths.parse(bad)


def test_fixed_length_entries_make_every_allowed_response_exactly_that_long():
  tok = loading.tiny_tokenizer()
  actions = ["push up", "move left", "push down"]
  forced = constrained.ActionConstraint(prefix="<action>", suffix="")
  for length in (30, 41):
    entries = paper_iteration.fixed_length_entries(actions, length, tok.encode, max_new=64)
    seqs = constrained.constrained_token_sequences(entries, forced, tok.encode)
    assert [constrained.min_length(s) for s in seqs] == [length] * 3
    # exactly as many free tokens as the draw leaves (min = max), then the newline
    spans = [t for s in seqs for t in s if isinstance(t, constrained.FreeSpan)]
    assert all(s.min_tokens == s.max_tokens >= 1 for s in spans) and len(spans) == 3
    assert all(e[0].endswith("</action>") and e[-1] == "\n" for e in entries)
  # A draw shorter than the action itself: one free token (the shortest response).
  short = paper_iteration.fixed_length_entries(actions, 2, tok.encode, max_new=64)
  assert [s[1].max_tokens for s in short] == [1, 1, 1]
  # No room to pad at all: the bare action; a free query entry (a tuple) stays as it is.
  query = ("search[", constrained.FreeSpan(8, "[]<>"), "]")
  tight = paper_iteration.fixed_length_entries(["push up", query], 64, tok.encode, max_new=3)
  assert tight == ["push up</action>", query]


def test_accelerator_mode_refuses_a_cpu_in_one_line():
  done = _bench("--model", "tiny", timeout=300)
  assert done.returncode == 2 and done.stdout == ""
  assert done.stderr.count("\n") == 1 and done.stderr.startswith(
      "paper_iteration: found only CPUs"), done.stderr
  assert "--allow-cpu" in done.stderr


def test_bad_flags_end_in_one_usage_line_not_a_traceback():
  done = _bench("--allow-cpu", "--envs", "12", timeout=120)
  assert done.returncode == 2 and "Traceback" not in done.stderr
  assert done.stderr.strip().splitlines()[-1].endswith(
      "--envs 12: give a positive multiple of 8 (groups of 8)")
  done = _bench("--allow-cpu", "--length-multiple", "-1", timeout=120)
  assert done.returncode == 2 and "Traceback" not in done.stderr
  assert done.stderr.strip().splitlines()[-1].endswith(
      "--length-multiple -1: give 0 (no grouping) or a positive number of tokens")


FIELD = re.compile(r"(\w+)=(\S+)")


@pytest.mark.slow
def test_tiny_cpu_run_prints_consistent_iteration_lines():
  done = _bench("--allow-cpu", "--model", "tiny", "--env", "sokoban", "--envs", "8",
                "--turns", "1", "--iterations", "2", "--response-lengths", "fixed:24",
                "--max-new-tokens", "48")
  assert done.returncode == 0, done.stderr[-3000:]
  lines = done.stdout.splitlines()
  assert lines[0].startswith("jax ")
  assert "tiny random init, float32 parameters, bfloat16 compute; " in lines[0]
  assert "sokoban x 8 envs (groups of 8), 1 turns, 2 iterations" in lines[0]
  assert "(micro 8, grouped by length in multiples of 256 tokens)" in lines[0]
  chips = int(re.match(r"jax \S+ on (\d+) x cpu \(cpu\); ", lines[0])[1])  # the suite fakes 8
  its = [l for l in lines if l.startswith("iteration ")]
  assert [l.split(":")[0] for l in its] == ["iteration 1", "iteration 2"]
  per_chip = []
  for line in its:
    f = {k: v for k, v in FIELD.findall(line)}
    assert list(f)[:6] == ["wall_s", "generation_s", "env_s", "advantages_s", "logprobs_s",
                           "update_s"]
    wall, steps = float(f["wall_s"]), int(f["steps"])
    phases = sum(float(f[p]) for p in paper_iteration.PHASES)
    assert 0 < phases <= wall + 1e-3
    assert steps == 8  # 8 envs x 1 turn
    assert int(f["response_tokens"]) == 24 * steps  # fixed:24: every response 24 tokens
    assert int(f["tokens"]) == int(f["prompt_tokens"]) + int(f["response_tokens"])
    assert int(f["chips"]) == chips
    # tokens/s per chip = tokens / wall / chips, computed from the unrounded wall: the
    # printed wall (to 1 ms) bounds it within tokens / chips x 0.5 ms / wall^2 (a wall of
    # 0.45 s is 0.11 % off), the printed rate is rounded to 0.1
    per_chip_tokens = int(f["tokens"]) / int(f["chips"])
    assert float(f["tokens_per_s_per_chip"]) == pytest.approx(
        per_chip_tokens / wall, rel=0, abs=per_chip_tokens * 5e-4 / (wall - 5e-4) ** 2 + 0.06)
    assert 0 < float(f["update_mfu"]) < 1 and 0 < float(f["logprobs_mfu"]) < 1
    assert f["peak_memory_gib"] == "n/a"  # CPUs report no device memory
    # grouped by length: the 8 steps alone (the builder's copies up to the 32-row
    # mini-batch dropped), each row padded to a multiple of 256 slots (512 here: prompts of
    # ~480 tokens + 24); the padded layout would be 32 rows of 512 + 48 slots (fill 0.22)
    fill = float(f["token_fill"])
    slots_per_row = int(f["tokens"]) / steps / fill
    assert 0.5 < fill <= 1 and abs(slots_per_row - 256 * round(slots_per_row / 256)) < 1.5
    per_chip.append(float(f["tokens_per_s_per_chip"]))
  assert "response lengths drawn: 16, mean 24.0" in lines
  last = lines[-1]
  median = float(re.match(r"tokens/s per chip: ([\d.]+) \(median of iterations 2..2\)", last)[1])
  assert median == pytest.approx(per_chip[1], abs=0.06)
  # the ratio is of the unrounded median: compared within the printed digits' rounding
  # (620.1 / 2340 = 0.26500 prints as 0.26 or 0.27 as the median's hidden digits fall)
  tail = re.search(r"vs the HiPER authors' 2340 per H100 \(ALFWorld log: mean prompt 734, "
                   r"response 176 tokens\): ([\d.]+)x \(target >= 4x\)$", last)
  assert tail, last
  assert float(tail[1]) == pytest.approx(median / 2340, abs=0.005 + 0.05 / 2340)


def test_random_presets_load_without_weights_with_the_bundled_tokenizer(monkeypatch):
  """A pretrained preset without `path`: the preset's config in the run's dtype, a random
  init (stubbed here: 1.5B parameters), and SmolLM2's tokenizer; other names load as before."""
  inits = []
  monkeypatch.setattr(loading, "load_model", loading.load_model)  # undone after the test
  monkeypatch.setattr(loading, "init_model", lambda cfg, **kw: inits.append((cfg, kw)) or "model")
  paper_iteration._install_random_presets()
  model, tok, cfg = loading.load_model("qwen2.5-1.5b", dtype="bfloat16", seed=3)
  assert model == "model" and inits[0][1]["seed"] == 3
  assert cfg.vocab_size == 151936 and cfg.num_layers == 28 and cfg.param_dtype == "bfloat16"
  assert tok.vocab_size == 49152 and tok.encode("<action>go to desk 1</action>")
  with pytest.raises(FileNotFoundError, match="is not a directory"):  # a path: the real loader
    loading.load_model("qwen2.5-1.5b", path="/nonexistent/qwen")
