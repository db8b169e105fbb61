"""Every golden value of docs/algorithms.md §11.2-11.4, through the library and the CLI."""

import json
import subprocess
import sys

import numpy as np
import pytest

import advantage_cases
from hgpo_jax.advantages import __main__ as cli
from hgpo_jax.advantages import build_row_batch
from hgpo_jax.advantages import gigpo
from hgpo_jax.advantages import registry

G = [0, 1, 2, 3, 4, 5, 6]  # rows of the successful g1 trajectories


def _column(spec: dict) -> np.ndarray:
  """Expands {row or tuple of rows: value} into a 19-vector."""
  out = np.full(19, np.nan)
  for rows, value in spec.items():
    out[list(rows) if isinstance(rows, tuple) else rows] = value
  assert not np.isnan(out).any()
  return out


_G1_OK, _G1_FAIL = tuple(G), (7, 8, 9)
_G2_OK, _G2_FAIL = (10, 12, 13, 14, 15), (16, 17, 18)

# (estimator, options, CLI flags, expected column of docs/algorithms.md §11.2-11.4)
CASES = {
    "grpo_traj": ("grpo", dict(stats="trajectories"), ["--stats", "trajectories"], _column(
        {_G1_OK: 0.577350, _G1_FAIL: -1.154700, _G2_OK: 0.577350, 11: 0.577350, _G2_FAIL: -1.154700})),
    "grpo_rows": ("grpo", dict(), [], _column(
        {_G1_OK: 0.621059, _G1_FAIL: -1.449137, _G2_OK: 0.669991, 11: 0.649958, _G2_FAIL: -1.333305})),
    "rloo_traj": ("rloo", dict(stats="trajectories"), ["--stats", "trajectories"], _column(
        {_G1_OK: 5.0, _G1_FAIL: -10.0, _G2_OK: 5.0, 11: 5.0, _G2_FAIL: -10.0})),
    "rloo_rows": ("rloo", dict(), [], _column(
        {_G1_OK: 3.333333, _G1_FAIL: -7.777778, _G2_OK: 3.762500, 11: 3.650000, _G2_FAIL: -7.487500})),
    "gigpo_std_rows": ("gigpo", dict(), [], np.array([
        1.242208, 1.487084, 0.621059, 1.153473, 0.621059, 1.487084, 0.621059, -2.602701,
        -2.315163, -2.315163, 1.033985, 1.804659, 1.234632, 0.669991, 1.234632, 0.669991,
        -2.826580, -1.910655, -1.910655])),
    "gigpo_mean_rows": ("gigpo", dict(norm="mean"), ["--norm", "mean"], np.array([
        6.158750, 7.750000, 3.000000, 5.707500, 3.000000, 7.750000, 3.000000, -12.866250,
        -11.750000, -11.750000, 5.024757, 9.194444, 5.951007, 3.344444, 5.951007, 3.344444,
        -13.548993, -9.630556, -9.630556])),
    "gigpo_std_traj": ("gigpo", dict(stats="trajectories"), ["--stats", "trajectories"], np.array([
        1.198500, 1.443375, 0.577350, 1.109764, 0.577350, 1.443375, 0.577350, -2.308264,
        -2.020726, -2.020726, 0.941344, 1.732050, 1.141991, 0.577350, 1.141991, 0.577350,
        -2.647975, -1.732050, -1.732050])),
    "hgpo_recipe_a1_std": ("hgpo", dict(k=2, alpha=1.0), ["--k", "2"], np.array([
        0.760749, 1.000000, 0, 0.652071, 0, 0.999999, 0, -1.412820, -1.000000, -0.999999,
        0.420304, 1.165685, 0.651990, 0, 0.651990, 0, -1.724284, -0.882842, -0.707106])),
    "hgpo_recipe_a1_mean": ("hgpo", dict(norm="mean"), ["--norm", "mean"], np.array([
        3.158748, 4.749999, 0, 2.707499, 0, 4.749998, 0, -5.866247, -4.749999, -4.749998,
        1.680312, 5.057499, 2.606561, 0, 2.606561, 0, -6.893434, -3.867499, -2.974999])),
    "hgpo_paper_a1_std": ("hgpo", dict(weights="paper"), ["--weights", "paper"], np.array([
        0.760750, 1.000000, 0, 0.652071, 0, 1.000000, 0, -1.412821, -1.000000, -1.000000,
        0.420304, 1.138071, 0.651991, 0, 0.651991, 0, -1.724285, -0.902369, -0.707107])),
    "hgpo_paper_a0_std": ("hgpo", dict(weights="paper", alpha=0.0),
                          ["--weights", "paper", "--alpha", "0"], np.array([
        0.760750, 1.000000, 0, 0.652071, 0, 1.000000, 0, -1.412821, -1.000000, -1.000000,
        0.420304, 1.207107, 0.651991, 0, 0.651991, 0, -1.724285, -0.853553, -0.707107])),
    "hgpo_recipe_a1_std_base": ("hgpo", dict(base_group=True), ["--base-group"], np.array([
        0.714186, 0.936843, 0.621058, 0.641733, 0.621058, 0.873686, 0.621058, -1.424926,
        -1.074856, -1.149712, 0.503533, 1.079731, 0.657991, 0.669991, 0.657991, 0.669991,
        -1.593958, -0.957919, -0.915839])),
    # weights="inverse_variance" (beyond the papers): values of the float64 reference
    # (reference.hgpo); row 17 is derived by hand in tests/analysis/test_level_weights.py.
    "hgpo_inverse_variance_std": ("hgpo", dict(weights="inverse_variance"),
                                  ["--weights", "inverse_variance"], np.array([
        0.760750, 1.000000, 0, 0.652071, 0, 1.000000, 0, -1.412821, -1.000000, -1.000000,
        0.420304, 1.263590, 0.651991, 0, 0.651991, 0, -1.724285, -0.813613, -0.707107])),
    "hgpo_inverse_variance_mean": ("hgpo", dict(weights="inverse_variance", norm="mean"),
                                   ["--weights", "inverse_variance", "--norm", "mean"], np.array([
        3.158750, 4.750000, 0, 2.707500, 0, 4.750000, 0, -5.866250, -4.750000, -4.750000,
        1.680313, 5.409091, 2.606562, 0, 2.606562, 0, -6.893438, -3.515909, -2.975000])),
    # docs/algorithms.md §11.4: K=1 gives the same values as K=2 on this batch (level 2 is all singletons).
    "hgpo_recipe_k1": ("hgpo", dict(k=1), ["--k", "1"], np.array([
        0.760749, 1.000000, 0, 0.652071, 0, 0.999999, 0, -1.412820, -1.000000, -0.999999,
        0.420304, 1.165685, 0.651990, 0, 0.651990, 0, -1.724284, -0.882842, -0.707106])),
}


def _assert_golden(actual, expected):
  # Six printed decimals: rtol 1e-5 (docs/algorithms.md §11), atol for the rounding of small values.
  np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1.5e-6)
  # A golden 0 is an exact zero (singletons, equal-return groups), not round-off.
  assert np.all(actual[expected == 0] == 0.0)


def test_returns_and_scores_match_spec_table():
  grouped = build_row_batch(advantage_cases.golden_rows(), capacity=24)
  ret = grouped.to_input_order(grouped.batch.returns)
  score = grouped.to_input_order(grouped.batch.score)
  np.testing.assert_allclose(ret, [9.025, 9.5, 10, 8.57375, 9.025, 9.5, 10, 0, 0, 0, 8.57375,
                                   8.925, 9.5, 10, 9.5, 10, 0, 0, 0], rtol=1e-6)
  np.testing.assert_allclose(score, [10] * 7 + [0] * 3 + [10, 9.9, 10, 10, 10, 10, 0, 0, 0],
                             rtol=1e-6)


@pytest.mark.parametrize("case", sorted(CASES))
def test_library_golden(case):
  name, options, _, expected = CASES[case]
  est = registry.get(name)
  actual = advantage_cases.kernel_advantages(
      advantage_cases.golden_rows(), name, est.options(**options), num_levels=3, capacity=32)
  _assert_golden(actual, expected)


@pytest.mark.parametrize("norm,expected", [
    ("mean_std", [0.621149, 0.866025, 0, 0.532414, 0, 0.866025, 0, -1.153563, -0.866025,
                  -0.866025, 0.363994, 1.154700, 0.564640, 0, 0.564640, 0, -1.493275,
                  -0.577350, -0.577350]),
    ("mean", [3.158750, 4.750000, 0, 2.707500, 0, 4.750000, 0, -5.866250, -4.750000,
              -4.750000, 1.680313, 5.950000, 2.606562, 0, 2.606562, 0, -6.893438,
              -2.975000, -2.975000]),
])
def test_gigpo_step_term_golden(norm, expected):
  grouped = build_row_batch(advantage_cases.golden_rows(), capacity=32)
  step = gigpo.step_advantage(grouped.batch, gigpo.GiGPOOptions(norm=norm))
  _assert_golden(grouped.to_input_order(np.asarray(step)), np.array(expected))


def _write_shuffled_dump(tmp_path):
  """The golden rows in a shuffled order with an extra field; returns (path, row ids)."""
  rows = advantage_cases.golden_rows()
  for i, row in enumerate(rows):
    row["row_id"] = i
  perm = np.random.default_rng(3).permutation(len(rows))
  path = tmp_path / "golden.jsonl"
  path.write_text("".join(json.dumps(rows[i]) + "\n" for i in perm))
  return path, perm


def _check_cli_output(text, perm, expected):
  out = [json.loads(line) for line in text.splitlines()]
  assert [r["row_id"] for r in out] == perm.tolist()  # input order, extra field kept
  adv = np.empty(19)
  adv[perm] = [r["advantage"] for r in out]
  _assert_golden(adv, expected)
  ret = np.empty(19)
  ret[perm] = [r["return"] for r in out]
  np.testing.assert_allclose(ret[[0, 11]], [9.025, 8.925], rtol=1e-6)


@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_golden_in_process(case, tmp_path, capsys):
  name, _, flags, expected = CASES[case]
  path, perm = _write_shuffled_dump(tmp_path)
  assert cli.main([str(path), "--estimator", name] + flags) == 0
  _check_cli_output(capsys.readouterr().out, perm, expected)


def _run_cli(args):
  return subprocess.run([sys.executable, "-m", "hgpo_jax.advantages"] + args,
                        capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.parametrize("case", ["hgpo_paper_a1_std", "gigpo_std_rows"])
def test_cli_golden_subprocess(case, tmp_path):
  name, _, flags, expected = CASES[case]
  path, perm = _write_shuffled_dump(tmp_path)
  proc = _run_cli([str(path), "--estimator", name] + flags)
  assert proc.returncode == 0, proc.stderr
  _check_cli_output(proc.stdout, perm, expected)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_cli_golden_subprocess_all(case, tmp_path):
  name, _, flags, expected = CASES[case]
  path, perm = _write_shuffled_dump(tmp_path)
  proc = _run_cli([str(path), "--estimator", name] + flags)
  assert proc.returncode == 0, proc.stderr
  _check_cli_output(proc.stdout, perm, expected)
