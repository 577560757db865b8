"""Writing and reading ``colo.trace/1``: the writer (structlog, one file per rank)
and the reader (pure, forgiving of one cut-off last line)."""
