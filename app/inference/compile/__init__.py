"""Compile a model library for a target (the model, quantization and pipeline packages are
its inputs), keep it in the cache, build and fetch prebuilt bundles, and the CUDA build support.
Nothing here runs a model."""
