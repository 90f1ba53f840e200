"""Evaluation: a traced step under many schedules, predicted against measured (Session), and the training step the command line describes (workload)."""
