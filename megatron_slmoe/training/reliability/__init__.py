"""Staying up on a large job, each concern with its callback beside it: the attempt record (who
ran where, and why it ended; ``attempts``), hang detection by heartbeat (``heartbeat``),
stragglers named by their compute time per step (``stragglers``), and how a worker ends: with its
parent, at SIGTERM, or ending the job on a failure that would repeat (``lifeline``)."""
