"""One module per ``llmchat`` subcommand: ``HELP``, ``add_arguments(parser)``, ``run(args)``."""
