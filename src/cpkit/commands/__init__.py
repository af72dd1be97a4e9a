"""One module per `cpkit` subcommand; see cpkit.cli."""
