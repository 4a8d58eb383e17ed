"""``llmchat serve``: llmchat's engine behind an OpenAI-compatible HTTP API (``server.py``), one
sequence at a time (``scheduler.py``); ``run.py`` starts uvicorn."""
