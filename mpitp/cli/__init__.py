"""The ``mpitp`` command: one module per subcommand."""
