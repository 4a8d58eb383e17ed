# The two commands of the README. Each makes its own virtual environment in .venv.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

# the suite's workers (pytest-xdist): one per CPU, at most 4 (each may hold a compiled model and
# lavapipe's threads); a test file stays on one worker, its module fixtures built once.
# TEST_WORKERS= runs it in one process.
TEST_WORKERS ?= -n auto --maxprocesses 4 --dist loadfile

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
	$(BIN)/python -m pytest -q $(TEST_WORKERS) $(PYTEST_ARGS)

test-gpu: $(BIN)/llmchat  ## the GPU suite (tests/gpu, marker gpu) on an NVIDIA GPU; a skip fails it
	LLMCHAT_NO_SKIP=1 $(BIN)/python -m pytest -q -m gpu -rs $(PYTEST_ARGS) tests/gpu

screenshots: $(BIN)/llmchat  ## the README's pictures (assets/*.svg) from the real app under Pilot
	$(BIN)/python tools/screenshots.py

# The GPU suite on a machine without TVM's compiler (tests/gpu/prebuilt.py): compile what it needs
# here (TVM's compiler and nvcc, no GPU), carry GPU_CACHE there and run test-gpu-prebuilt with the
# Python that has llmchat's dependencies (PY); anything missing or stale in the cache fails
GPU_ARCH ?= sm_90
# the Vulkan adapter profile of the WGSL libraries (tests/gpu/test_engine_vulkan.py): the H200's
# NVIDIA driver; `llmchat doctor --json` names an adapter's (lavapipe: wgsl-f16-wg32768-t256)
GPU_WGSL_PROFILE ?= wgsl-f16-wg49152-t256
GPU_CACHE ?= scratch/gpu-test-cache
PY ?= python3
gpu-cache: $(BIN)/llmchat  ## compile everything the GPU suite needs into GPU_CACHE (no GPU needed)
	$(BIN)/python -m tests.gpu.prebuilt build --arch $(GPU_ARCH) --wgsl-profile $(GPU_WGSL_PROFILE) \
		--out $(GPU_CACHE)

# The Vulkan loader of a machine that lacks it comes from .debs in .gl/ (unpacked into /, as root),
# NVIDIA's ICD from the driver's files; the WebGPU add-on is built there, into the cache, if missing
test-gpu-prebuilt:  ## the GPU suite loading only from GPU_CACHE (no TVM compiler; no venv made)
	@if ls .gl/*.deb >/dev/null 2>&1 && ! $(PY) -c "import ctypes; ctypes.CDLL('libvulkan.so.1')" 2>/dev/null; \
		then for f in .gl/*.deb; do dpkg -x "$$f" /; done; ldconfig; fi
	if [ -z "$$VK_DRIVER_FILES" ] && ! ls /usr/share/vulkan/icd.d/*nvidia* /etc/vulkan/icd.d/*nvidia* \
		>/dev/null 2>&1 && [ -f /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json ]; then \
		export VK_DRIVER_FILES=/usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json; fi; \
	LLMCHAT_CACHE_DIR=$(GPU_CACHE)/llmchat-cache $(PY) -m app.inference.backends.webgpu.addon --optional; \
	LLMCHAT_GPU_TEST_CACHE=$(GPU_CACHE) LLMCHAT_NO_SKIP=1 $(PY) -m pytest -q -m gpu -rs -p no:cacheprovider \
		$(PYTEST_ARGS) tests/gpu

lint: $(BIN)/llmchat
	$(BIN)/ruff check app tests
	$(BIN)/ruff format --check app tests

clean:
	rm -rf $(VENV) $(LLAMACPP_VENV) build *.egg-info
