"""Tokens to whole pages: validation, padding, pairing and page runs."""
