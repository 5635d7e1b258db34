"""The broker's own tasks, run by the system worker on the reach.* queues."""
