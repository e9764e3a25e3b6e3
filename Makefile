# The commands the README gives. Each one sets up .venv first (scripts/bootstrap is a no-op when
# nothing changed), so a fresh clone needs nothing but python3.
PY := .venv/bin/python
export DS_ACCELERATOR := cpu
export TOKENIZERS_PARALLELISM := false
export RAY_USAGE_STATS_ENABLED := 0

.PHONY: setup test test-fast demo bench lint dist

setup:
	@scripts/bootstrap

# Two test processes share the cores: one torch thread per process (Ray workers included, see
# rlhf_cli.rl.run.cpu_threads) keeps OpenMP from spinning against the other process.
# The format check first: layout is ruff's, so a size measure or a review cannot be moved by wrapping.
test: setup
	$(PY) -m ruff format --check -q packages tests examples bench
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 --dist loadgroup --timeout 900 $(PYTEST_ARGS)

test-fast: setup
	OMP_NUM_THREADS=1 $(PY) -m pytest -n 2 -m "not slow" $(PYTEST_ARGS)

demo: setup
	$(PY) -m rlhf_cli.demo $(DEMO_ARGS)

bench: setup
	$(PY) bench/sft_vs_trl.py --reps 6 --steps 10 --threads 1
	$(PY) bench/engine_decode.py
	$(PY) bench/engine_vllm_cpu.py
	$(PY) bench/grpo_vs_trl.py

lint: setup
	$(PY) -m ruff check packages tests examples bench
	$(PY) -m ruff format --check packages tests examples bench

# A wheel and an sdist of each of the six packages into dist/ (each wheel is built from its sdist, so a file
# missing from the sdist fails here). No build isolation: the pinned setuptools of .venv builds them offline.
dist: setup
	rm -rf dist
	for p in packages/*/; do $(PY) -m build --no-isolation --outdir dist $$p || exit 1; done
	@ls dist
