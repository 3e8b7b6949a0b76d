# The two entry points of the README. Both create .venv on first use.
#   make test   install (with the test extra) and run the test suite
#   make demo   install, then serve the embedded tiny model and stream one chat reply with curl
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
DEMO_MODEL := .ktlite/tiny-deepseek-v3
# On a machine without an NVIDIA driver, take the CPU build of torch (an unpinned torch pulls a
# multi-GB CUDA build). With a driver, or a torch already in the venv, nothing is forced.
CPU_TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: test demo install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if ! $(PY) -c "import torch" 2>/dev/null; then \
	  if command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install torch; \
	  else $(PY) -m pip install "$(CPU_TORCH)"; fi; \
	fi
	$(PY) -m pip install -e ".[test]"
	touch $(STAMP)

# Two test processes, each taking whole files (their module fixtures built once): on the 2-core CI machine numba's
# first compiles and the tests bound by one Python thread overlap instead of queueing
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

$(DEMO_MODEL)/config.json: | $(STAMP)
	$(VENV)/bin/ktlite tiny-model $(DEMO_MODEL)

demo: $(STAMP) $(DEMO_MODEL)/config.json
	$(PY) -m ktlite.demo $(DEMO_MODEL)

clean:
	rm -rf $(VENV) .ktlite
