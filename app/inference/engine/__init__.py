"""Run a compiled model: the TVM engine (``tvm_engine.load_engine``), its runtime, the
generation loop, sampling, stop strings, tokenizer and chat templates; and the other engines
(``remote``: an OpenAI-compatible server, ``mlc_engine``: MLC-LLM's), all behind ``api.Engine``."""
