"""Tests of colo.transports: every transport, staging, the wire format, the declared engine protocols."""
