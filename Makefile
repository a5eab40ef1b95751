# Two commands do all the set-up: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export PREFECT_SERVER_ANALYTICS_ENABLED := false
export TOKENIZERS_PARALLELISM := false
export HF_HUB_OFFLINE := 1
export DO_NOT_TRACK := 1

.PHONY: install demo test test-all test-fast clean

install: $(STAMP)

# The model families of transformers other than those fulltune's tests and examples build (each family's
# __init__ and configuration stay compiled: the auto classes read those), and packages the dependencies
# bring that no process of fulltune imports.
NOT_IMPORTED := /transformers/models/(?!auto/|llama/|gpt2/|gpt_neox/|qwen2/|qwen3/|gemma2?/|mistral/)[^/]+/(?!__init__|configuration_)|/site-packages/(databricks|sklearn|nltk|fontTools|apprise|setuptools|narwhals|dateparser|rich_rst|joblib)/

# torch first, pinned: a looser range would pull a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet --no-compile torch==2.13.0 uv
	# The rest through uv, which resolves and unpacks in parallel (the same 208 packages at the same versions in 7 s,
	# where pip took 50 s here); through pip where uv cannot (an index configured for pip alone).
	$(BIN)/uv pip install --quiet --python $(BIN)/python -e '.[dev,eval]' || \
		$(BIN)/pip install --quiet --no-compile -e '.[dev,eval]'
	# Byte-compiled on every core: pip compiles on one (83 s of a 187 s install here), compileall -j 0 on two takes
	# 36 s, 26 s without the packages' own test suites (21% of the bytes; nothing imports them), 21.6 s without
	# the largest parts that fulltune and its tests never import (NOT_IMPORTED; half the bytes are never read).
	# A module left out still imports, compiled when it is.
	$(BIN)/python -m compileall -q -j 0 -x '/tests/|$(NOT_IMPORTED)' $(VENV)/lib > /dev/null || true
	touch $(STAMP)

# torchao (`fulltune[lowbit]`: float8 training, 4-bit states) for the tests that prove them, in a directory of its
# own that only their processes put on PYTHONPATH (tests/lowbit.py): where torchao is installed, transformers imports
# it with every model it builds (+0.5 s of CPU per such process, measured), which the rest of the suite need not pay.
LOWBIT := .lowbit
LOWBIT_STAMP := $(LOWBIT)/.installed

$(LOWBIT_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --no-compile --no-deps --target $(LOWBIT) $$(sed -n 's/^lowbit = \["\(.*\)"\]/\1/p' pyproject.toml)
	touch $(LOWBIT_STAMP)

demo: install
	$(BIN)/fulltune run demo

# Two workers (pytest-xdist), a test file each at a time, the longest first (tests/conftest.py LONGEST_FIRST).
# FULLTUNE_TEST_LOWBIT=required: a test that needs torchao fails instead of skipping when .lowbit is missing.
# OMP_NUM_THREADS=1: the two workers and the processes they start already fill the cores; a second OpenMP thread
# per process only spins waiting for a core the other worker holds (19-21% more CPU for the same tests, measured
# side by side: BENCHMARKS.md). Tests that compare thread counts set their own.
test: install $(LOWBIT_STAMP)
	$(BIN)/python -m compileall -q -j 0 fulltune flows tasks tests benchmarks > /dev/null
	OMP_NUM_THREADS=1 FULLTUNE_TEST_LOWBIT=required $(BIN)/python -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not heavy"

test-all: install $(LOWBIT_STAMP)
	FULLTUNE_TEST_LOWBIT=required $(BIN)/python -m pytest -q

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow and not server"

clean:
	rm -rf .fulltune $(LOWBIT)
