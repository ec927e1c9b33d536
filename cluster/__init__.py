"""Process wiring: the command line, configuration, and (later) Ray placement and Redis."""
