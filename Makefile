# The two commands of the README, and the steps they are made of. Each sets up what it needs on a fresh machine.
#   make demo   hide a fact in Austen, ask the embedded SmolLM2 for it, with and without our presses
#   make test   install pinned deps, build (CPU + CUDA kernels), run GoogleTest via ctest, then pytest (and again
#               under transformers 5.2 and 5.17)
#   make eval   the evaluation results run (resumable), then its CSV, plots and report (docs/evaluation.md)
#   make gpu-check   on a machine with a GPU and no network: build for it (or use make gpu-prebuild's), CUDA tests, compute-sanitizer, op and
#               decode benchmarks, results in benchmarks/results/gpu/ (see benchmarks/gpu_check.py)
SHELL := /bin/bash
VENV ?= .venv
PYTHON := $(VENV)/bin/python
DEBIAN_PACKAGES := libgtest-dev cmake
# nvcc on PATH may be a wrapper script (then torch would guess CUDA_HOME wrongly); prefer the real toolkit.
export CUDA_HOME ?= $(firstword $(wildcard /usr/local/cuda))
# CI has no GPU: build for sm_90 (H100/H200) only, which keeps the CUDA compile short.
export TORCH_CUDA_ARCH_LIST ?= 9.0
export MAX_JOBS ?= 2
# Unit tests never touch a model hub, nor load kernels from one (transformers 5.25 does by default, and refuses to
# load any model without the `kernels` package).
export HF_HUB_OFFLINE := 1
export USE_HUB_KERNELS := NO
# The transformers 5 versions the suite runs under again (py-test-transformers5, below), and those it can be run
# under by hand (make py-test-transformers5.24: the newest release, outside CI's time).
TRANSFORMERS5_VERSIONS := 5.2 5.17
TRANSFORMERS5_VENVS := $(foreach version,$(TRANSFORMERS5_VERSIONS),.venv-transformers$(version)/.installed)
TRANSFORMERS5_BY_HAND := 5.24

.PHONY: demo test build cpp-test py-test py-test-transformers5 $(addprefix py-test-transformers,$(TRANSFORMERS5_VERSIONS) $(TRANSFORMERS5_BY_HAND)) system-deps clean eval eval-report eval-smoke gpu-check gpu-prebuild gpu-wheels

demo: build
	$(PYTHON) examples/demo.py

# What waits on the network or apt (the transformers 5 venvs, GoogleTest's package) runs beside the extension's
# compile, which waits on the CPU; the tests then run one after another.
test:
	$(MAKE) -j 4 --output-sync=target $(EXTENSION) system-deps $(TRANSFORMERS5_VENVS)
	$(MAKE) cpp-test py-test py-test-transformers5

# EVAL_ARGS: e.g. --model meta-llama/Llama-3.1-8B-Instruct --device cuda:0 --lengths 4096 16384 --examples 20
# --out results/llama (a hub model also needs `make eval HF_HUB_OFFLINE=0 ...`). One CPU thread: CPU time is what
# the default plan is sized for. EVAL_WORKERS: processes side by side, one thread and one model each (on a CPU with
# cores to spare, e.g. EVAL_WORKERS=$$(nproc); keep 1 for a large model on one GPU).
EVAL_ARGS ?=
EVAL_WORKERS ?= 1
eval: build
	OMP_NUM_THREADS=1 $(PYTHON) -m kvpress_cpp.evaluation.results all --threads 1 --workers $(EVAL_WORKERS) $(or $(EVAL_ARGS),--document docs/evaluation.md)

eval-report: build
	$(PYTHON) -m kvpress_cpp.evaluation.results report $(or $(EVAL_ARGS),--document docs/evaluation.md)

# The smoke evaluation (also part of `make test`): a tiny model through kvpress's evaluate.py and the results runner.
eval-smoke: build
	$(PYTHON) -m pytest tests/test_evaluation.py -q

$(VENV)/.installed: requirements.txt
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install --quiet --upgrade pip
	$(PYTHON) -m pip install --quiet -r requirements.txt
	touch $@

# The extension is rebuilt when a source, setup.py, the venv or a build setting changes, not by every target that
# needs it: pip's editable build compiles from scratch each time (5-11 minutes on two cores), which every `make demo`
# paid. The settings (with the package version, which the install records) name a file under build/extension-settings/
# that their rule writes there alone: a make with other settings, or back with earlier ones, finds its file missing
# and rebuilds. pip names the extension otherwise on some Pythons (3.15's platform tag, free-threaded builds): then
# the build stops rather than leave a stale file.
EXTENSION := kvpress_cpp/_C.abi3.so
EXTENSION_SETTINGS_TEXT := $(PYTHON) CUDA_HOME=$(CUDA_HOME) TORCH_CUDA_ARCH_LIST=$(TORCH_CUDA_ARCH_LIST) \
  KVCOMP_FORCE_CPU=$(KVCOMP_FORCE_CPU) KVCOMP_CPU_ARCH=$(KVCOMP_CPU_ARCH) \
  $(shell grep '^__version__' kvpress_cpp/__init__.py)
EXTENSION_SETTINGS := build/extension-settings/$(firstword $(shell echo '$(EXTENSION_SETTINGS_TEXT)' | md5sum))
build: $(EXTENSION)

$(EXTENSION_SETTINGS):
	rm -rf $(@D) && mkdir -p $(@D) && echo '$(EXTENSION_SETTINGS_TEXT)' > $@

$(EXTENSION): $(VENV)/.installed setup.py $(EXTENSION_SETTINGS) $(shell find csrc -type f)
	rm -f $@
	@echo "make: compiling the extension (CPU kernels, and CUDA ones with a CUDA torch): 5-11 minutes on two cores"
	$(PYTHON) -m pip install --quiet --no-build-isolation --no-deps -e .
	@test -f $@ || { echo "make: pip built no $@ (this Python names the extension otherwise)"; exit 1; }

system-deps:
	@missing=$$(for p in $(DEBIAN_PACKAGES); do dpkg -s $$p >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" != 0 ]; then echo "make: need Debian packages: $$missing (run: sudo apt-get install $$missing)"; exit 1; fi; \
	  apt-get update -qq && apt-get install -y -qq $$missing; \
	fi

# GoogleTest against the extension `build` made (KVCOMP_OPS_LIBRARY): the ops pytest loads, compiled once.
cpp-test: build system-deps
	mkdir -p build && cmake -S . -B build/cmake -DPython3_EXECUTABLE=$(abspath $(PYTHON)) -DCMAKE_BUILD_TYPE=Release \
	  -DKVCOMP_OPS_LIBRARY=$(abspath $(EXTENSION)) > build/cmake-configure.log 2>&1 \
	  || (cat build/cmake-configure.log; exit 1)
	cmake --build build/cmake -j $(MAX_JOBS)
	ctest --test-dir build/cmake --output-on-failure

# Two pytest workers of one thread each, as the transformers 5 runs below: on CI's two cores one process took 10.4
# min, most of it Python on one core, of a CI run that must stay under 45.
py-test: build
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest tests -q -n 2 -p no:cacheprovider

# The suite again under transformers 5: 5.2 (the newest kvpress 0.5.5 allows, what a `pip install` resolves) and 5.17
# (the offline GPU machine's). Each runs in a venv holding only the pins of requirements-transformers<version>.txt,
# which sees .venv's packages and built extension behind them (a .pth that adds .venv's site-packages), on two pytest
# workers of one thread each (two workers of two threads on two cores run 1.6x slower than one process). The modules
# marked independent_of_transformers (the ops against their references, ~150 s of test time) run in the first pass
# only: they run no transformers code (tests/test_suite_marks.py). So do the tests marked default_model_answers (what
# SmolLM2 answers under each press, ~200 s): the later passes compare those presses on SmolLM2 token by token.
define transformers5_run
.venv-transformers$(1)/.installed: requirements-transformers$(1).txt $$(VENV)/.installed
	test -x .venv-transformers$(1)/bin/python || python3 -m venv .venv-transformers$(1)
	echo "import site; site.addsitedir('$$$$($$(PYTHON) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")')" \
	  > "$$$$(.venv-transformers$(1)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/kvpress_cpp_base.pth"
	set -o pipefail; .venv-transformers$(1)/bin/python -m pip install --quiet -r requirements-transformers$(1).txt 2>&1 \
	  | { grep -v "kvpress 0.5.5 requires transformers\|dependency resolver\|dependency conflicts" || true; }
	.venv-transformers$(1)/bin/python -c "import transformers, torch, kvpress; \
	  assert transformers.__version__.startswith('$(1).'), transformers.__version__"
	touch $$@

py-test-transformers$(1): build .venv-transformers$(1)/.installed
	OMP_NUM_THREADS=1 .venv-transformers$(1)/bin/python -m pytest tests -q -n 2 -p no:cacheprovider \
	  -m "not independent_of_transformers and not default_model_answers"
endef
$(foreach version,$(TRANSFORMERS5_VERSIONS) $(TRANSFORMERS5_BY_HAND),$(eval $(call transformers5_run,$(version))))
py-test-transformers5: $(addprefix py-test-transformers,$(TRANSFORMERS5_VERSIONS))

# gpu-check uses the GPU machine's own Python (GPU_PYTHON, with torch, transformers and nvcc there; our pins are not
# installable without network) and installs the wheels of .whl/ beside it, for what it lacks: kvpress and the packages
# kvpress imports. `make gpu-wheels` fetches them (on a machine with network); carry .whl/ to the GPU machine.
# GPU_CHECK_ARGS: e.g. --stages tests sanitizer --timeout 900.
GPU_PYTHON ?= python3
GPU_CHECK_ARGS ?=
GPU_SITE := build/gpu-site
# accelerate: transformers' device_map (tests/test_device_map.py); pytest-xdist: the CUDA tests on several workers.
GPU_WHEELS := kvpress==0.5.5 cachetools==5.5.2 datasets==5.0.1 dill==0.4.1 multiprocess==0.70.19 fire==0.7.1 \
              termcolor==3.3.0 accelerate==1.15.0 psutil==7.2.2 pytest==9.2.0 pluggy==1.7.0 iniconfig==2.3.1 \
              pytest-xdist==3.8.0 execnet==2.1.2
# One wheel at a time: a wheel built for another Python than the GPU machine's is skipped, not fatal.
gpu-check:
	@for wheel in $(wildcard .whl/*.whl); do \
	  $(GPU_PYTHON) -m pip install -q --no-index --no-deps --no-compile --upgrade --target $(GPU_SITE) $$wheel \
	    >/dev/null 2>&1 || echo "gpu-check: skipped $$wheel (not for this Python)"; done
	PYTHONPATH=$(CURDIR)/$(GPU_SITE)$${PYTHONPATH:+:$$PYTHONPATH} MAX_JOBS=$$(nproc) \
	  $(GPU_PYTHON) -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

# The extension built here against the GPU machine's torch (GPU_BUILD_PYTHON: a venv holding that torch, e.g.
# torch==2.11.0 from the cu130 wheels), for sm_90, stripped, into build/gpu-prebuilt/: carry that folder and run
# `make gpu-check GPU_CHECK_ARGS="--prebuilt build/gpu-prebuilt/_C.abi3.so ..."`, which then spends no device time
# compiling (falling back to a build there if it does not load). x86-64-v3 CPU code: the GPU machine's CPU may lack
# this one's AVX-512.
GPU_BUILD_PYTHON ?=
gpu-prebuild:
	@test -n "$(GPU_BUILD_PYTHON)" || { echo "make gpu-prebuild: set GPU_BUILD_PYTHON to a Python with the GPU machine's torch"; exit 1; }
	KVCOMP_CPU_ARCH=x86-64-v3 $(GPU_BUILD_PYTHON) setup.py build_ext --build-temp build/gpu-temp --build-lib build/gpu-lib
	mkdir -p build/gpu-prebuilt
	strip --strip-debug -o build/gpu-prebuilt/_C.abi3.so build/gpu-lib/kvpress_cpp/_C.abi3.so

gpu-wheels:
	python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl $(GPU_WHEELS)

clean:
	rm -rf build $(VENV) $(addprefix .venv-transformers,$(TRANSFORMERS5_VERSIONS)) *.egg-info kvpress_cpp/*.so
