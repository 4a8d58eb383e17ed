"""Device back ends that need more than the TVM wheel gives: ``webgpu`` (Vulkan through
wgpu-native, with llmchat's own device API for TVM)."""
