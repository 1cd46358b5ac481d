"""The front door: requests in (OffloadService, after= producers, thread submissions)."""
