# The two commands of the README. Each makes its own virtual environment in .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: run test test-gpu gpu-cache test-gpu-prebuilt lint clean screenshots

# llama.cpp's OpenAI-compatible server (llama-cpp-python[server], compiled from source: minutes) in
# a virtual environment of its own, for the remote engine's test against a third-party server
LLAMACPP_VENV := .venv-llamacpp

$(BIN)/llmchat: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@# the Vulkan and ROCm add-ons are C++: the system compiler builds it, or PyPI's ziglang where there is none (SteamOS)
	@command -v c++ >/dev/null 2>&1 || command -v g++ >/dev/null 2>&1 || command -v clang++ >/dev/null 2>&1 \
		|| $(BIN)/python -m pip install --quiet ziglang
	-$(BIN)/python -m app.inference.backends.webgpu.addon --optional
	@# llmchat's ROCm runtime (HIP opened at run time: builds without ROCm)
	-$(BIN)/python -m app.inference.backends.hip.addon --optional
	touch $@

$(LLAMACPP_VENV)/bin/python:
	$(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install --quiet --upgrade pip
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(LLAMACPP_VENV)/bin/python -m pip install --quiet \
		'llama-cpp-python[server]==0.3.36'

run: $(BIN)/llmchat  ## install and start the chat app
	$(BIN)/llmchat $(ARGS)

test: $(BIN)/llmchat  ## install and run the linter, the formatter's check and the tests
	$(BIN)/ruff check app tests
	$(BIN)/ruff format --check app tests
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

test-gpu: $(BIN)/llmchat  ## the GPU suite (tests/gpu, marker gpu) on an NVIDIA GPU; a skip fails it
	LLMCHAT_NO_SKIP=1 $(BIN)/python -m pytest -q -m gpu -rs $(PYTEST_ARGS) tests/gpu

screenshots: $(BIN)/llmchat  ## the README's pictures (assets/*.svg) from the real app under Pilot
	$(BIN)/python tools/screenshots.py

# The GPU suite on a machine without TVM's compiler (tests/gpu/prebuilt.py): compile what it needs
# here (TVM's compiler and nvcc, no GPU), carry GPU_CACHE there and run test-gpu-prebuilt with the
# Python that has llmchat's dependencies (PY); anything missing or stale in the cache fails
GPU_ARCH ?= sm_90
GPU_CACHE ?= scratch/gpu-test-cache
PY ?= python3
gpu-cache: $(BIN)/llmchat  ## compile everything the GPU suite needs into GPU_CACHE (no GPU needed)
	$(BIN)/python -m tests.gpu.prebuilt build --arch $(GPU_ARCH) --out $(GPU_CACHE)

test-gpu-prebuilt:  ## the GPU suite loading only from GPU_CACHE (no TVM compiler; no venv made)
	LLMCHAT_GPU_TEST_CACHE=$(GPU_CACHE) LLMCHAT_NO_SKIP=1 $(PY) -m pytest -q -m gpu -rs -p no:cacheprovider \
		$(PYTEST_ARGS) tests/gpu

lint: $(BIN)/llmchat
	$(BIN)/ruff check app tests
	$(BIN)/ruff format --check app tests

clean:
	rm -rf $(VENV) $(LLAMACPP_VENV) build *.egg-info
