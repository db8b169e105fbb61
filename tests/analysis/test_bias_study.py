"""The bias study command end to end (`--quick`), and its plan."""

import os
import subprocess
import sys

import pytest

from launch.studies import bias

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
  proc = subprocess.run([sys.executable, "-m", "launch.studies.bias", "--quick", "--out",
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
