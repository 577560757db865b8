"""Many ranks: one process per GPU holding a trainer rank, its engine rank and its transport.

- :mod:`colo.ranks.host` — :class:`RankHost`, what one rank does (inside a
  worker process, or a Ray actor): builds the trainer rank in the trainer's
  process group, starts the engine rank on the same GPU in the engine's TP
  group, and runs the sync from its own trainer rank straight to its own
  engine rank.
- :mod:`colo.ranks.worker` — the worker process: a ``RankHost`` served over the
  authenticated channel.
- :mod:`colo.ranks.proxy` — the driver's side: a trainer rank, an engine rank
  and a transport per worker that the unchanged :class:`~colo.scheduler.Scheduler`
  drives as groups.
"""
