"""Ways to run the service inside hosts that are not asyncio programs (see each module)."""
