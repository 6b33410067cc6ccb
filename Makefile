# fencepost — every target creates .venv and installs when needed.
PY        ?= python3
VENV      ?= .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.installed
SERVE_STAMP := $(VENV)/.installed-serve
PROTO_SRC := $(wildcard proto/fencepost/v1/*.proto)
GEN_DIR   := clients/python
ADDR      ?= 127.0.0.1:50051
DB        ?= ./fencepost.db
PYTEST_ARGS ?=
# parallel test workers (pytest-xdist); 0 runs the suite in one process
TEST_WORKERS ?= 2
TS_DIR    := clients/typescript
TS_STAMP  := $(TS_DIR)/node_modules/.package-lock.json

.DEFAULT_GOAL := help
.PHONY: help all serve test lint proto bench clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-11s %s\n", $$1, $$2}' \
	  | sed -e 's|$$(ADDR)|$(ADDR)|g' -e 's|$$(DB)|$(DB)|g'

# Two distributions, both installed editable from the checkout: the SDK
# (clients/python: fencepost) and the server (server: fencepost-server).
PKG_FILES := pyproject.toml clients/python/pyproject.toml server/pyproject.toml server/setup.py
EDITABLE  := -e clients/python -e server

$(STAMP): $(PKG_FILES)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(EDITABLE) -e '.[dev]'
	touch $(STAMP) $(SERVE_STAMP)

# Serving needs the packages and their runtime dependencies only (no dev tools).
$(SERVE_STAMP): $(PKG_FILES)
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet $(EDITABLE)
	touch $(SERVE_STAMP)

all: test  ## exactly what CI runs (lint + every test)

serve: $(SERVE_STAMP)  ## start the coordinator on $(ADDR) with the SQLite file $(DB) (dashboard on 127.0.0.1:8233)
	$(BIN)/fencepost serve --listen $(ADDR) --db $(DB)

# The dashboard's browser tests drive Debian's headless Chromium.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
.PHONY: browser
browser:  ## install chromium + chromium-driver (Debian) for the browser tests, when missing
	@test -x /usr/bin/chromedriver -a -x /usr/bin/chromium || { \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq chromium chromium-driver; }

# The PostgreSQL store's tests start their own throwaway servers from Debian's binaries.
.PHONY: postgres
postgres:  ## install Debian's postgresql (the tests start their own servers from it), when missing
	@ls /usr/lib/postgresql/*/bin/postgres >/dev/null 2>&1 || { \
	  $(SUDO) apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends postgresql; }

test: $(STAMP) lint browser postgres ts-build  ## lint, every test (slow ones included), then the container image built and run
	$(BIN)/python -m pytest -n $(TEST_WORKERS) --dist worksteal $(PYTEST_ARGS)
	$(MAKE) test-ts
	$(MAKE) image DIST=build/image

# The edit-and-test loop: lint, the unit tests and the ledger's wire tests on SQLite,
# in-process (no browser, no PostgreSQL, no slow tests); make test runs everything.
CHECK_TESTS ?= tests/unit tests/service
.PHONY: check
check: $(STAMP) lint  ## lint + unit and in-process wire tests on SQLite (no browser, no PostgreSQL; about a minute)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) -m "not slow" --no-postgres $(CHECK_TESTS)

lint: $(STAMP)  ## ruff and mypy on our own code; proto/ against the last released API (buf breaking)
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/python scripts/api_breaking.py

proto: $(STAMP) $(TS_STAMP)  ## regenerate the checked-in stubs from proto/ (Python and TypeScript)
	$(BIN)/python scripts/codegen.py $(GEN_DIR)
	cd $(TS_DIR) && npm run --silent generate

bench: $(STAMP)  ## benchmarks (not tests): end to end vs echo, and the writer alone
	$(BIN)/python bench/run_all.py

.PHONY: bench-peers
bench-peers: $(STAMP)  ## fencepost (SQLite and PostgreSQL stores) vs etcd, PostgreSQL, Redis and a do-nothing gRPC server, same load (installs them if missing; ~12 min)
	$(BIN)/python -c 'import asyncpg, redis, hiredis' 2>/dev/null || $(BIN)/python -m pip install --quiet asyncpg redis hiredis
	$(BIN)/python bench/peers --install

.PHONY: bench-shards
bench-shards: $(STAMP) postgres  ## coordinators leading shards apart on one PostgreSQL: 1-3+ coordinators (SDK), shard moves, crash failover (~10 min)
	$(BIN)/python bench/shards.py

.PHONY: bench-scale
bench-scale: $(STAMP)  ## costs as runs pile up: new-run cost, restart, RSS, filtered listing (1M runs; ~10 min)
	$(BIN)/python bench/scale.py

.PHONY: bench-failover
bench-failover: $(STAMP) postgres  ## failover on PostgreSQL: leader SIGKILL/SIGSTOP -> first ack on the new leader, 2 lease settings (~10 min)
	$(BIN)/python bench/failover.py

.PHONY: bench-takeover
bench-takeover: $(STAMP) postgres  ## how long a standby takes to lead with 1k, 100k and 1M runs stored (~8 min)
	$(BIN)/python bench/takeover.py

DURATION  ?= 60
SEED      ?= 1
TRANSPORT ?= mixed
SNAPSHOTS ?= fenced
STORE     ?= sqlite
COORDINATORS ?= 3
LEAD_SHARDS ?=
.PHONY: torture
torture: $(STAMP) $(if $(filter postgres,$(STORE)),postgres)  ## fault-injection run + checkers: make torture DURATION=60 SEED=1 TRANSPORT=unary|stream|mixed SNAPSHOTS=fenced|unfenced|off STORE=sqlite|postgres COORDINATORS=3 LEAD_SHARDS=1 (docs/RELIABILITY.md)
	$(BIN)/python -m torture --duration $(DURATION) --seed $(SEED) --transport $(TRANSPORT) --snapshots $(SNAPSHOTS) --store $(STORE) --coordinators $(COORDINATORS) $(if $(LEAD_SHARDS),--lead-shards)

# TypeScript clients (clients/typescript, docs/TYPESCRIPT.md): Node >= 20 and npm,
# installed from Debian when missing; dependencies exactly as package-lock.json.
$(TS_STAMP): $(TS_DIR)/package-lock.json $(TS_DIR)/package.json
	command -v npm >/dev/null || (apt-get update -q && apt-get install -y -q nodejs npm)
	cd $(TS_DIR) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

# Built before pytest too: the Python suite drives the TypeScript client (bench smoke, releases).
.PHONY: ts-build
ts-build: $(TS_STAMP)
	cd $(TS_DIR) && npm run --silent build

.PHONY: test-ts
test-ts: $(STAMP) $(TS_STAMP)  ## TypeScript clients: build, then their tests against real servers
	cd $(TS_DIR) && FENCEPOST_BIN=$(abspath $(BIN))/fencepost npm test

# Release artifacts. The wheels are built from the sdists (python -m build),
# with the venv's setuptools: no build environment to fetch.
DIST      ?= dist
VERSION    = $(shell $(BIN)/python -c 'import fencepost; print(fencepost.__version__)')
IMAGE_TAR  = $(DIST)/fencepost-server-$(VERSION).image.tar
TS_PACKAGES := client oma chamvi
.PHONY: dist dist-packages dist-python dist-npm image
dist-packages: dist-python dist-npm  ## the two Python sdists and wheels and the three npm tarballs in dist/

dist-python: $(STAMP)
	mkdir -p $(DIST)
	$(BIN)/python -m build --no-isolation --outdir $(DIST) clients/python
	$(BIN)/python -m build --no-isolation --outdir $(DIST) server

dist-npm: $(STAMP) $(TS_STAMP)
	mkdir -p $(DIST)
	cd $(TS_DIR) && npm run --silent build
	cd $(TS_DIR) && npm pack --silent --pack-destination $(abspath $(DIST)) \
	  $(foreach p,$(TS_PACKAGES),--workspace packages/$(p))

# The image is built with buildah from Debian's own packages (scripts/build_image.sh),
# then run with podman and checked: health check, a lifecycle, non-root, SIGTERM.
IMAGE_TOOLS := buildah podman debootstrap runc
image: $(STAMP)  ## build the container image into dist/ with buildah and check it runs with podman (~2 min)
	@for t in $(IMAGE_TOOLS); do command -v $$t >/dev/null || { \
	  $(SUDO) apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
	  $(SUDO) apt-get install -y -qq $(IMAGE_TOOLS); break; }; done
	mkdir -p $(DIST)
	scripts/build_image.sh $(VERSION) $(IMAGE_TAR)
	FENCEPOST_IMAGE=$(abspath $(IMAGE_TAR)) $(BIN)/python -m pytest -q -s -n 0 -p no:cacheprovider \
	  tests/release/test_image.py

dist: $(STAMP)  ## every artifact (sdists, wheels, npm tarballs, the image) in dist/ with SHA256SUMS
	rm -rf $(DIST)
	$(MAKE) dist-packages image DIST=$(DIST)
	cd $(DIST) && sha256sum $$(ls | grep -v '^SHA256SUMS$$') > SHA256SUMS

clean:  ## remove the venv, caches and build output (never your data: see clean-data)
	rm -rf $(TS_DIR)/node_modules $(TS_DIR)/packages/*/dist $(TS_DIR)/packages/*/tsconfig.tsbuildinfo
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build dist *.egg-info \
	  clients/python/build clients/python/*.egg-info server/build server/*.egg-info
	find . -name __pycache__ -type d -prune -exec rm -rf {} +

.PHONY: clean-data
clean-data:  ## DELETE the database $(DB) (with its -wal and -shm files): every run it holds
	@echo "deleting $(DB), $(DB)-wal and $(DB)-shm: every run recorded in them is gone"
	rm -f $(DB) $(DB)-wal $(DB)-shm
