"""The model store: the catalog, what is installed and whether it is whole, downloads from the
Hub, GGUF import, the default model, the files on disk (config, weights, hashes), whether a model
fits this machine and how fast it would decode here, and the saved servers."""
