"""Device back ends that need more than the TVM wheel gives, each with llmchat's own native add-on
for TVM's runtime (built by :mod:`.native_build`): ``webgpu`` (Vulkan through wgpu-native) and
``hip`` (ROCm through HIP opened at run time; its CUDA twin runs the same code on NVIDIA GPUs)."""
