"""The ``clgrpo`` commands, one module per command (a command with subcommands is one module): each defines its
command object (``common.Command`` or ``common.CommandGroup``: name, help line, arguments, what runs it), and
``application.cli`` registers them in order."""
