"""Widgets of the chat app: the chat log with Markdown replies, the stats line, the prompt input."""
