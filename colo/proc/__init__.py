"""Processes and what crosses between them.

- :mod:`colo.proc.channel` — the authenticated, never-unpickling control channel;
- :mod:`colo.proc.handles` — tensor handles as JSON and the only code that rebuilds them
  (host shared-memory segments here; CUDA kinds register from :mod:`colo.device.cuda_ipc`);
- :mod:`colo.proc.lifecycle` — socket dirs, a child's environment, dying with the parent,
  and the start-up sweep of what a killed run left behind;
- :mod:`colo.proc.rendezvous` — where a process group's ranks meet: a store served by
  the process that started them, so no port is chosen early and taken by another.
"""
