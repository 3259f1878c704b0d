# Two commands do all set-up on a fresh machine: `make report` and `make test`.
# The install step pins torch to the 2.13.0 CPU build (it lies on this machine's disk);
# pyproject itself asks only for torch>=2.5, so other users keep their own build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TORCH_PIN ?= torch==2.13.0
# Where `make report` writes. The committed reference report lives in runs/ and was made with
# `make reference`; a fresh machine's own figures go to runs/local/ (not committed).
RUNS ?= runs/local

.PHONY: test report reference verify bench lint format clean llama-cpp

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e ".[dev,data,triton,transformers,export]"
	touch $@

# pytest-xdist runs the suite in parallel, each test independent of order and process: one
# worker more than the cores, since many tests wait on the processes they start, and idle
# workers take tests from busy ones (worksteal). The suite starts dozens of Python
# processes, so Python keeps its bytecode (__pycache__, ignored by git) even where the
# environment sets PYTHONDONTWRITEBYTECODE: otherwise each would compile octlm again.
WORKERS ?= $(shell echo $$(( $$(nproc 2>/dev/null || echo 1) + 1 )))
test: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests examples
	$(VENV)/bin/ruff format --check src tests examples
	env -u PYTHONDONTWRITEBYTECODE $(PY) -m pytest -q -n $(WORKERS) --dist worksteal

# Each verify run tags its records with a run id; the report counts only the latest run.
verify: $(VENV)/.installed
	$(PY) -m octlm verify --quick --out $(RUNS)

bench: $(VENV)/.installed
	$(PY) -m octlm bench baseline --output $(RUNS)/bench-baseline-cpu.jsonl

# One round of the baseline suite (backends alternating, one process each) after the matmul
# probe: the baseline's shape in minutes on 2 cores (naive and the sketch at 8,192 tokens and
# naive in bfloat16 are left to `make reference`); --resume keeps what an earlier run measured.
report: $(VENV)/.installed
	$(PY) -m octlm verify --quick --out $(RUNS)
	$(PY) -m octlm bench baseline --resume --output $(RUNS)/bench-baseline-cpu.jsonl
	$(PY) -m octlm report --output $(RUNS)/report.md $(RUNS)/*.jsonl

# The reference figures README quotes: every CPU suite, the whole baseline grid and the
# training grid in three rounds, FLASH against tiled beside a competing process (--busy), ring
# attention, decoding and packed documents. About 1 h 25 min on 2 cores (docs/benchmarks.md);
# the last line writes the committed runs/report.md.
reference: $(VENV)/.installed
	$(PY) -m octlm verify --out runs
	$(PY) -m octlm bench reference --resume --rounds 3 \
		--output runs/bench-baseline-cpu.jsonl
	$(PY) -m octlm bench train --resume --rounds 3 --output runs/bench-train-cpu.jsonl
	$(PY) -m octlm bench structure --resume --output runs/bench-structure-cpu.jsonl
	$(PY) -m octlm bench route --resume --rounds 3 --output runs/bench-route-cpu.jsonl
	$(PY) -m octlm bench training --what attention --attention sdpa tiled auto \
		--lengths 256 1024 4096 --packing off on --dtypes float32 --rounds 3 \
		--output runs/bench-training-cpu.jsonl
	$(PY) -m octlm bench baseline --backends flash tiled --lengths 8192 --busy --rounds 3 --resume \
		--output runs/bench-contention-cpu.jsonl
	$(PY) -m octlm.lab.bench.ring --output runs/bench-ring-cpu.jsonl
	$(PY) -m octlm.lab.bench.ring --length 32768 --repeats 2 --output runs/bench-ring-cpu.jsonl
	$(PY) -m octlm bench decode --output runs/bench-decode-cpu.jsonl
	$(PY) -m octlm bench documents --output runs/bench-documents-cpu.jsonl
	$(PY) -m octlm report --output runs/report.md runs/*.jsonl

# llama.cpp's own checks of the GGUF exports (tests/integrations/test_gguf.py), which `make test` skips
# without it: llama-cpp-python, which pip builds from llama.cpp's source (a C++ compiler and
# CMake; several minutes on 2 cores). Then `make test` runs them.
llama-cpp: $(VENV)/.installed
	$(PY) -m pip install --quiet -e ".[llama-cpp]"

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check src tests examples

format: $(VENV)/.installed
	$(VENV)/bin/ruff format src tests examples
	$(VENV)/bin/ruff check --fix src tests examples

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
