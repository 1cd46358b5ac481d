"""Completion: the caller's handle on a request and what a finished request moved."""
