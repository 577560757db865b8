"""Demo and benchmark applications built on the library (``colo demo``, ``colo bench``)."""
