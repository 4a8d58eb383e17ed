"""`python -m app` runs the llmchat command line."""

from app.cli import main

raise SystemExit(main())
