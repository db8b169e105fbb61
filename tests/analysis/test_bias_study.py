"""The bias study command end to end (`--quick`), and its plan."""

import os
import subprocess
import sys

import pytest

from launch.experiments.studies import bias

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_plans_cover_the_issue():
  full = bias.make_plan(quick=False)
  assert full.sizes == (4, 8, 16) and len(full.seeds) >= 3
  names = [s.name for s in full.settings]
  assert any(s.beta == 0 for s in full.settings)  # Markov control
  assert any(s.horizon < bias.HORIZON for s in full.settings)  # binding time limit
  assert {"aliased", "noisy"} <= {s.obs for s in full.settings}
  assert len(set(names)) == len(names)
  labels = {e.label for e in bias.ESTIMATORS}
  for needed in ("GRPO", "RLOO", "GiGPO", "GiGPO mean", "HGPO K=0", "HGPO K=1", "HGPO K=2",
                 "HGPO K=4", "HGPO K=2 paper", "HGPO K=4 mean alpha=0", "HGPO K=4 mean alpha=2",
                 bias.STEP0, "MC: G_t - V(h_t) (noise floor)"):
    assert needed in labels


@pytest.mark.slow
def test_quick_study_writes_the_report(tmp_path):
  proc = subprocess.run([sys.executable, "-m", "launch.experiments.studies.bias", "--quick", "--out",
                         str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  text = (tmp_path / "bias_study.md").read_text()
  paragraphs = text.split("\n\n")
  assert paragraphs[0] == "# Estimator bias study"
  assert "**Verdict.**" in paragraphs[1] and "CI_0" in paragraphs[1]
  for heading in ("## Context-inconsistency index per level", "## Per-step bias^2",
                  "## Batch-gradient cosine", "## Paired cosine differences", "## Controls"):
    assert heading in text
  for png in ("bias_study_bias.png", "bias_study_cosine.png", "bias_study_ci.png"):
    assert (tmp_path / png).stat().st_size > 10_000
  # The Markov control has exactly consistent anchor groups up to time-left effects.
  row = next(line for line in text.splitlines() if line.startswith("| revisit2-b0 | 0."))
  assert float(row.split("|")[2].split()[0]) < 0.01


def test_critic_plan_sweeps_explained_variance_from_0_to_1():
  plan = bias.make_critic_plan(quick=False)
  assert plan.evs[0] == 0.0 and plan.evs[-1] == 1.0 and list(plan.evs) == sorted(plan.evs)
  assert set(plan.modes) == {"noise", "shrink"} and len(plan.seeds) >= 3
  assert any(s.beta == 0 for s in plan.settings) and any(s.family == "cue" for s in plan.settings)
  assert {name for _, name, _ in bias.CRITIC_ESTIMATORS} == {"gae", "hae"}
  assert all(label in bias.LABEL for label in bias.CRITIC_REFERENCES)


def test_critic_section_is_spliced_into_the_report():
  section = bias.CRITIC_BEGIN + "\nnew\n" + bias.CRITIC_END
  report = "# Estimator bias study\n\nbody\n"
  once = bias.splice_critic_section(report, section)
  assert once == report.rstrip("\n") + "\n\n" + section + "\n"
  old = once.replace("new", "old")
  assert bias.splice_critic_section(old, section) == once  # replaced, not appended twice


@pytest.mark.slow
def test_quick_critic_study(tmp_path):
  (tmp_path / "bias_study.md").write_text("# Estimator bias study\n\nkept\n")
  proc = subprocess.run([sys.executable, "-m", "launch.experiments.studies.bias", "--critic", "--quick", "--out",
                         str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600,
                        check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  text = (tmp_path / "bias_study.md").read_text()
  assert text.startswith("# Estimator bias study\n\nkept\n") and "**Reading.**" in text
  assert (tmp_path / "bias_study_critic.png").stat().st_size > 10_000
  # EV 1: GAE lambda=0 equals the exact advantage's cosine, GAE lambda=1 the MC one.
  rows = {line.split("|")[2].strip(): line for line in text.splitlines()
          if line.startswith("| revisit2-b4 | GAE")}
  head = next(line for line in text.splitlines() if line.startswith("| revisit2-b4 | 0."))
  exact, mc = float(head.split("|")[2]), float(head.split("|")[7])
  assert float(rows["GAE lambda=0 (TD)"].split("|")[-2]) == pytest.approx(exact, abs=1e-3)
  assert float(rows["GAE lambda=1"].split("|")[-2]) == pytest.approx(mc, abs=1e-3)
