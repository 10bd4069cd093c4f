"""The command line: `python -m engine COMMAND` (or `tokenpath COMMAND`), one module per group of commands.
It parses, calls the engine below it and prints; nothing below imports it."""
