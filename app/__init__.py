"""llmchat: a terminal chat app that runs LLMs locally, compiled for the local GPU with Apache TVM."""

__version__ = "0.1.0"
