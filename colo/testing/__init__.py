"""Test support, shared by colo's own tests and by anyone who tests code on colo:

- :mod:`colo.testing.fakes` — byte-counting fakes for the scheduler's unit tests
  (trainer, engine, transport) and ``protocol_engine``, an in-process engine of
  exactly the declared engine protocols;
- :mod:`colo.testing.trainers` — trainers of real tensors for transport tests
  (a state dict with a real extractor; a model in flat weights);
- :mod:`colo.testing.engines` — an engine wrapper that records (and can delay or
  hold) what is asked of the engine, and an engine's receiving side in-process;
- :mod:`colo.testing.transports` — a sender broken on purpose;
- :mod:`colo.testing.faults` — fault injection for real runs (``colo demo --fault``).
"""
