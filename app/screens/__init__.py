"""Screens of the chat app: chat, models, hardware, first run, loading, conversations."""
