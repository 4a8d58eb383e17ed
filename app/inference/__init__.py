"""Everything that compiles and runs models, in the order data flows through it:

``hardware/`` (what is here, which device) → ``store/`` (the catalog, the models on disk, downloads,
imports) → ``compile/`` (a model library for the device; its inputs ``models/``, ``quantization/``,
``pipelines/``) → ``engine/`` (load, generate; ``backends/`` are llmchat's device runtimes) → the UI.

The UI and the CLI call it through one facade, ``app.inference.services`` (``Services``), and
program against the types in ``app.inference.api``; nothing outside this package imports TVM.
"""
