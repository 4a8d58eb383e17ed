"""The tiny chat model fixtures of the screen tests, shared with the terminal test."""

from tests.screens.conftest import chat_engine, chat_model_dir

__all__ = ["chat_engine", "chat_model_dir"]
