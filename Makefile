# `make demo` and `make test` set everything up in .venv/ (first run only) and go.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
UV     := $(VENV)/bin/uv --no-progress
export OMP_WAIT_POLICY := PASSIVE

.PHONY: setup demo test docs docs-build mutation clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip uv
	# torch first, pinned and by pip (which finds a machine's local wheel): an open range would pull a multi-GB
	# CUDA build on CPU machines
	$(PY) -m pip install --quiet torch==2.13.0
	# the rest by uv: the same versions as pip resolves, in ~8 s instead of ~47; the torch above satisfies
	# torch>=2.6, so nothing is pulled for it
	$(UV) pip install --quiet --compile-bytecode --python $(PY) -e ".[test]"
	touch $(STAMP)

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/rlhflab demo

# every test on both cores at once (pytest-xdist): a file whose tests share a torchrun launch, a demo run or a wheel
# goes to one worker whole (tests/conftest.py); `-m "not processes"` leaves out the ones that start processes
test: $(STAMP)
	$(PY) -m pytest -q -n 2

# the documentation site (docs/, mkdocs.yml): served at http://127.0.0.1:8000 with live reload; docs-build fails
# on a broken link or a missing API object, as CI's tests/docs/test_docs_build.py does
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve

docs-build: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict  # into build/site

# mutation testing (benchmarks/mutation.py, docs/mutation.md): mutmut over every listed module, or one with
# MODULE=src/rlhflab/core/losses.py; the table goes to mutants/table.md. Not part of CI (hours on 2 cores)
$(VENV)/.mutation: $(STAMP) pyproject.toml
	$(UV) pip install --quiet --compile-bytecode --python $(PY) -e ".[mutation]"
	touch $@

mutation: $(VENV)/.mutation
	nice -n 10 $(PY) benchmarks/mutation.py $(MODULE)

clean:
	rm -rf $(VENV) runs .pytest_cache mutants
