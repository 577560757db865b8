"""Test support: fakes for scheduler unit tests and fault injection for real runs."""
