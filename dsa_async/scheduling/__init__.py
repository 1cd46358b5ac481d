"""Scheduling: queues, batching, backpressure and the happens-before rules."""
