"""Conformance suite (see mhattn.conformance.suite)."""
