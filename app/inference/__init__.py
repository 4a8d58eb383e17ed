"""Everything that compiles and runs models, plus the hardware probe and the model catalog.

The UI and the CLI use the small API in ``app.inference.api`` (types) and the factory
``app.inference.engine.tvm_engine.load_engine``; nothing outside this package imports TVM.
"""
