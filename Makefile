# Everything a fresh machine needs: `make up` runs Tandem on embedded defaults, `make test`
# runs the checks CI runs. Both create .venv and install the project into it first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install up test lint unit bench clean deploy-tools image

# torch==2.13.0 (CPU) is pinned in pyproject.toml and installed in the same pip command as
# transformers, so pip never pulls the multi-GB CUDA build. constraints.txt holds every other
# dependency at the version the suite last passed with.
$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -c constraints.txt -e '.[dev,bench]'
	touch $(STAMP)

install: $(STAMP)

up: install
	$(BIN)/tandem up

lint: install
	$(BIN)/ruff check tandem kernels services tests benchmarks
	$(BIN)/mypy tandem

# The Kubernetes/Helm tests use a real kube-apiserver + etcd and the real helm binary. Both are
# built/installed once into /var/cache/tandem (outside the clone; ~10 min cold, then instant).
deploy-tools:
	scripts/ensure-kube.sh
	scripts/ensure-helm.sh
	scripts/ensure-prometheus.sh

unit: install deploy-tools
	$(BIN)/pytest -q

test: lint unit

# OCI image without a registry (mmdebstrap + buildah; see deploy/image/README.md):
# dist/tandem-<version>-<VARIANT>.oci.tar and localhost/tandem:<version>-<VARIANT>.
# VARIANT=cuda: torch and NIXL built for CUDA 13 (PyPI): GPU nodes need an R580+ driver.
VARIANT ?= cpu
image: install
	scripts/build-image.sh $(VARIANT)

bench: install
	$(BIN)/python benchmarks/bench_engine.py all

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
